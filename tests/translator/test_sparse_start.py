"""The shipped sparse start: the FVT-like plan as the start, the source marginal its row sums and the floor
on the weights. On a planted problem whose start has the right source and one wrong one per target, training keeps
P as sparse as its start while it moves the mass to the right source; without the floor, the last column step
refills every column that its row step left short with a full column of tiny weights."""
import torch

from bench.bench_planted import make_problem, oracle_loss
from s2t2_dist.engines.torch_engine import TorchEngine
from s2t2_dist.ot.prior import row_marginal
from s2t2_dist.train.config import OptimConfig
from s2t2_dist.translator import PStats, TokenTranslator, TranslatorConfig


def setup_module():
    torch.set_num_threads(1)


def _start(pb, seed=0):
    """Column j: 0.6 of nu_j on a wrong source, 0.4 on the planted one (as FVT splits a token over its pieces)."""
    g = torch.Generator().manual_seed(seed)
    nu = torch.full((pb.u,), 1.0 / pb.u, dtype=torch.float64)
    wrong = (pb.sigma + torch.randint(1, pb.v, (pb.u,), generator=g)) % pb.v
    F = torch.zeros(pb.v, pb.u, dtype=torch.float64)
    F[wrong, torch.arange(pb.u)] += 0.6 * nu
    F[pb.sigma, torch.arange(pb.u)] += 0.4 * nu
    return F, nu


def _train(pb, F, nu, floor, steps=120):
    torch.manual_seed(0)
    tr = TokenTranslator(pb.v, pb.u, mu=row_marginal(F), nu=nu, floor=floor)
    tr.init_from_dense(F)
    nnz0 = int((tr.P() != 0).sum())
    lr = TranslatorConfig(kind="sparse").resolve(pb.v, pb.u).lr  # the stage's automatic lr (the start's marginal)
    eng = TorchEngine.build(tr, OptimConfig(lr=lr, weight_decay=0.0), steps, params="sharded")
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, pb.train.shape[0], (32,), generator=g)
        E, L = tr.embed_and_head(pb.E, pb.L)
        eng.backward(pb.loss(E, L, pb.train[idx]))
        eng.step()
    with torch.no_grad():
        E, L = tr.embed_and_head(pb.E, pb.L)
        W = tr.weights(tr.P(), "head")
        return {"nnz0": nnz0, "nnz": int((W != 0).sum()), "held": float(pb.loss(E, L, pb.held)),
                "right": float(W[pb.sigma, torch.arange(pb.u)].mean()), "col_err": PStats(tr).marginal_errors()["col_err"]}


def test_sparse_start_stays_sparse_and_learns():
    pb = make_problem(32, 64, "split", n_train=1024, n_held=128)
    F, nu = _start(pb)
    r = _train(pb, F, nu, floor=1.0)
    assert r["nnz0"] == int((F != 0).sum()) == 2 * pb.u, r  # the start is its own plan: no entry added
    assert r["nnz"] <= r["nnz0"], r  # no support growth (at most 2 per column of 32 sources)
    assert r["right"] > 0.6, r  # the mass moved to the planted source (0.4 at the start)
    assert r["held"] - oracle_loss(pb) < 0.3, r
    assert r["col_err"] < 1e-6, r  # columns still carry nu_j after the floor's rescaling
    dense = _train(pb, F, nu, floor=0.0)
    assert dense["nnz"] > 4 * r["nnz"], (dense, r)  # the lifted columns the floor removes


def test_flat_column_takes_the_best_source_of_C():
    """A column the row step empties entirely comes back from the column step as nu_j / v on every source (all
    tied, so the floor keeps them all: seen on stories260K, benchmarks/stage1_stories260k_cpu2_2026-11-27.md); the
    plan gives it C's largest entry of that column instead, and leaves the other columns as they were."""
    v, u = 8, 6
    tr = TokenTranslator(v, u, floor=1.0)
    C = torch.full((v, u), -1.0 / v, dtype=tr.C.dtype)
    C[torch.arange(v), torch.arange(v) % (u - 1)] = 2.0 / v  # every row's mass goes to columns 0..4
    C[5, u - 1] = -0.5 / v  # column 5: below every row's threshold; its largest entry is source 5
    with torch.no_grad():
        tr.C.copy_(C)
    P = tr.P().detach()
    nu = tr.nu.to(P.dtype)
    assert torch.allclose(P.sum(0), nu)  # still feasible in the columns
    assert int((P[:, u - 1] != 0).sum()) == 1 and float(P[5, u - 1]) == float(nu[u - 1])
    kept = P[:, : u - 1]
    assert torch.equal((kept != 0).sum(0), torch.tensor([2, 2, 2, 1, 1]))  # the learned columns untouched
    with torch.no_grad():  # the same column with nothing learned (C flat there): it stays uniform
        tr.C[:, u - 1] = -1.0 / v
    assert torch.allclose(tr.P().detach()[:, u - 1], nu[u - 1] / v)
