"""The planted-translation benchmark (bench/bench_planted.py) in miniature, and the freeze monitor on it: the
shipped step sizes learn the planted map; the paper's absolute lr at lr x v >> 1 freezes C, which the gradient
monitor reports and the start-up check warns about."""
import torch

from bench.bench_planted import make_problem, oracle_loss, run_one, uniform_loss
from s2t2_dist.translator import freeze_warning, resolve_step


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
    assert r["lr_x_v"] == resolve_step("sparse", 16).lr * 16
    assert r["recovery"] >= 0.9, r
    assert r["held_loss"] - oracle_loss(pb) < 0.1, r
    assert r["grad_zero_steps"] == 0 and r["grad_live_frac"] > 0.01, r
    assert freeze_warning("sparse", 50280, resolve_step("sparse", 50280).lr) == ""


def test_paper_lr_at_large_lr_x_v_freezes_and_is_detected():
    pb = make_problem(64, 16, "many", n_train=256, n_held=64)
    r = run_one(pb, "sparse", recipe="paper", lr=0.05, steps=60)  # lr x v = 3.2, as the paper's 1e-3 at v = 3,200
    assert r["grad_live_frac"] == 0.0 and r["grad_zero_steps"] >= 20, r
    assert "freezing range" in freeze_warning("sparse", 64, 0.05)
    assert "freezing range" in freeze_warning("sparse", 50280, resolve_step("sparse", 50280, recipe="paper").lr)
    assert freeze_warning("softmax", 50280, 1e-3) == ""
