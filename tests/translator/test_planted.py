"""The planted-translation benchmark (bench/bench_planted.py) in miniature, and the freeze monitor on it: the
shipped step sizes learn the planted map; the paper's absolute lr at lr x v >> 1 freezes C, which the gradient
monitor reports and the start-up check warns about."""
import torch

from bench.bench_planted import make_problem, oracle_loss, resolve, run_one, train, uniform_loss
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


def test_dense_warm_up_hands_its_plan_to_the_sparse_translator():
    """The bench's dense warm-up (the first half softmax, then sparse from its P): two phases, each a translator of
    its own kind; the sparse one starts at the warm-up's P (its first plan is that P projected) and ends sparse."""
    pb = make_problem(8, 16, "split", n_train=32, n_held=8)
    step = resolve("sparse", pb.v, pb.u, dense_frac=0.5, steps=8)
    assert [(k, n) for k, _, n in step.phases()] == [("softmax", 4), ("sparse", 4)]
    warm, _, _ = train(pb, resolve("softmax", pb.v, pb.u, steps=4, lr=0.0), generator=torch.Generator().manual_seed(0))
    assert warm.kind == "softmax" and bool((warm.P() > 0).all())
    tr, _, _ = train(pb, step, generator=torch.Generator().manual_seed(0))
    assert tr.kind == "sparse" and bool((tr.P() == 0).any())
    # no phase: the run's kind alone, all steps
    assert [(k, n) for k, _, n in resolve("softmax", pb.v, pb.u, steps=8).phases()] == [("softmax", 8)]
