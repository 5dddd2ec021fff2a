import pytest
import torch

from s2t2_dist.train.config import OptimConfig
from s2t2_dist.train.optim import cosine_lr_factor


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
    cfg = OptimConfig(lr=2e-5, weight_decay=0.01, betas=[0.9, 0.95], eps=1e-5, warmup_frac=0.2, final_lr_frac=0.1)
    opt = cfg.build([w, b])
    assert opt.param_groups[0]["weight_decay"] == 0.01 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-5
    sched = cfg.schedule(opt, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-5 * 0.5)
    for _ in range(9):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-6)


def test_reshard_moves_columns_and_adam_moments_exactly(tmp_path):
    """A column-sharded parameter and its Adam moments saved by 2 ranks, re-split for 3 ranks (and 1): each new
    rank gets exactly its columns of the full matrices; the step count and schedule are carried over."""
    from s2t2_dist.distributed.sharded_sinkhorn import shard_bounds
    from s2t2_dist.engines.torch_engine import reshard

    v, u = 5, 7
    full = {k: torch.randn(v, u, generator=torch.Generator().manual_seed(i)) for i, k in
            enumerate(("C", "exp_avg", "exp_avg_sq"))}
    for r in range(2):
        a, b = shard_bounds(u, 2, r)
        torch.save({"world_size": 2, "params": {"C": full["C"][:, a:b].clone()},
                    "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": full["exp_avg"][:, a:b].clone(),
                                                "exp_avg_sq": full["exp_avg_sq"][:, a:b].clone()}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]},
                    "scheduler": {"last_epoch": 4}, "layout": {"C": [1, a, b, u]}},
                   tmp_path / f"engine_rank{r:05d}.pt")
    for world in (3, 1):
        for r in range(world):
            a, b = shard_bounds(u, world, r)
            C = torch.nn.Parameter(torch.zeros(v, b - a))
            st = reshard(tmp_path, 2, {"C": [1, a, b, u]}, [("C", C)])
            assert torch.equal(st["params"]["C"], full["C"][:, a:b])
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st["optimizer"]["state"][0][k], full[k][:, a:b])
            assert float(st["optimizer"]["state"][0]["step"]) == 4.0 and st["scheduler"] == {"last_epoch": 4}
    # a checkpoint whose ranges leave a gap is refused, naming the ranges
    bad = torch.load(tmp_path / "engine_rank00001.pt", weights_only=True)
    bad["layout"]["C"] = [1, 5, 7, u]
    torch.save(bad, tmp_path / "engine_rank00001.pt")
    with pytest.raises(RuntimeError, match=r"saved ranges of C \[\(0, 4\), \(5, 7\)\] do not cover \[0, 7\)"):
        reshard(tmp_path, 2, {"C": [1, 0, 7, u]}, [("C", torch.nn.Parameter(torch.zeros(v, u)))])
