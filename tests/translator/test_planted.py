"""The planted-translation benchmark (bench/bench_planted.py) in miniature, and the freeze monitor on it: the
shipped step sizes learn the planted map; the paper's absolute lr at lr x v >> 1 freezes C, which the gradient
monitor reports and the start-up check warns about."""
import torch

from bench.bench_planted import make_problem, oracle_loss, resolve, run_one, uniform_loss
from s2t2_dist.translator import TranslatorConfig, freeze_warning


def setup_module():
    torch.set_num_threads(1)


def test_planted_problem_oracle_beats_uniform():
    pb = make_problem(16, 32, "split", n_train=64, n_held=64)
    assert pb.train.shape == (64, 33) and int(pb.train.max()) < 32
    assert torch.equal(torch.bincount(pb.sigma, minlength=16), torch.full((16,), 2))  # each source: 2 targets
    assert oracle_loss(pb) < uniform_loss(pb) - 1.0


def test_default_recipe_learns_planted_map_and_stays_alive():
    pb = make_problem(16, 32, "split", n_train=512, n_held=128)
    r = run_one(pb, "sparse", steps=100)
    auto = TranslatorConfig(init="uniform").resolve(16, 32)  # the bench's start: C = 1/v, mu = 1/v
    assert r["lr_x_v"] == auto.lr * 16 == auto.lr_x_v
    assert r["recovery"] >= 0.9, r
    assert r["held_loss"] - oracle_loss(pb) < 0.1, r
    assert r["grad_frozen_steps"] == 0 and r["grad_live_frac"] > 0.01, r
    assert TranslatorConfig(init="uniform").resolve(50280, 512).freeze_warning() == ""


def test_paper_lr_at_large_lr_x_v_freezes_and_is_detected():
    pb = make_problem(64, 16, "many", n_train=256, n_held=64)
    r = run_one(pb, "sparse", recipe="paper", lr=0.05, steps=60)  # lr x v = 3.2, as the paper's 1e-3 at v = 3,200
    assert r["grad_live_frac"] == 0.0 and r["grad_frozen_steps"] >= 20, r
    assert "freezing range" in freeze_warning("sparse", 64, 0.05)
    assert "freezing range" in TranslatorConfig().resolve(50280, 512, lr=1e-3).freeze_warning()  # the paper's lr
    assert freeze_warning("softmax", 50280, 1e-3) == ""


def _train(pb, steps, total, tmp=None, resume=None):
    from s2t2_dist.engines.torch_engine import TorchEngine
    from s2t2_dist.train.config import OptimConfig
    from s2t2_dist.translator import TokenTranslator

    tr = TokenTranslator(pb.v, pb.u, dtype=torch.float64)
    schedule = resolve("sparse", pb.v, pb.u, dense_frac=0.5, steps=total).apply_init(tr)
    eng = TorchEngine.build(tr, OptimConfig(lr=1.0), total, params="sharded")
    start = 0
    if resume is not None:
        eng.load(resume)
        start = eng.scheduler.last_epoch
    for s in range(start, steps):
        schedule(s, eng)
        E, L = tr.embed_and_head(pb.E.double(), pb.L.double())
        eng.backward(pb.loss(E.float(), L.float(), pb.train[s % 8 * 4: s % 8 * 4 + 4]))
        eng.step()
    if tmp is not None:
        eng.save(tmp)
    return tr


def test_dense_warm_up_switch_and_resume_at_any_step(tmp_path):
    """The bench's dense warm-up (steps 0-3 softmax, then sparse from its P): a run stopped and resumed before, exactly at, or
    after the switch ends with the uninterrupted run's P; the end plan is sparse."""
    pb = make_problem(8, 16, "split", n_train=32, n_held=8)
    ref = _train(pb, 8, 8)
    assert ref.kind == "sparse" and bool((ref.P() == 0).any())
    for stop in (2, 4, 6):
        d = tmp_path / f"s{stop}"
        d.mkdir()
        _train(pb, stop, 8, tmp=d)
        again = _train(pb, 8, 8, resume=d)
        assert again.kind == "sparse"
        torch.testing.assert_close(again.P(), ref.P(), rtol=0, atol=1e-12)
