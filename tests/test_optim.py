import pytest
import torch

from s2t2_dist.train.optim import build_adamw, build_scheduler, cosine_lr_factor


def test_schedule_shape_matches_paper():
    total = 100
    f = [cosine_lr_factor(s, total, 0.2, 0.1) for s in range(total)]
    assert f[0] == pytest.approx(1 / 20) and f[19] == pytest.approx(1.0)  # linear warm-up over 20% of steps
    assert all(a < b for a, b in zip(f[:20], f[1:20]))
    assert all(a >= b for a, b in zip(f[20:], f[21:]))  # then monotone decay
    assert f[-1] == pytest.approx(0.1)  # ends at 10% of the peak


def test_adamw_paper_settings_and_groups():
    w = torch.nn.Parameter(torch.ones(3, 3))
    b = torch.nn.Parameter(torch.ones(3))
    opt = build_adamw([w, b], lr=2e-5, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-5)
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-5
    sched = build_scheduler(opt, 10, 0.2, 0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-5 * 0.5)
    for _ in range(9):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-6)
