"""The translated rows' product (translator/product.py): the CPU kernel reads only P's live rows, and the gradient on
C through the sparse translator equals (float64) the dense product's, with dead rows in P. The CUDA kernels under
Triton's interpreter: tests/helpers/scripts/gpu_kernels_interpreted.py."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import s2t2_dist.translator.module as module
from tests.helpers.distributed import run_distributed
from s2t2_dist.translator import TokenTranslator
from s2t2_dist.translator.product import DENSE_FRACTION, live_rows, plan_product
from s2t2_dist.utils.syncs import count_host_syncs

REPO = Path(__file__).resolve().parents[2]


def _sparse_rows(v, u, live, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.rand(v, u, generator=g, dtype=torch.float64)
    P = torch.where(torch.rand(v, u, generator=g, dtype=torch.float64) < 0.3, P, torch.zeros(()))
    rows = torch.randperm(v, generator=g)[:live]
    keep = torch.zeros(v, dtype=torch.bool)
    keep[rows] = True
    return torch.where(keep[:, None], P, torch.zeros(())), keep


@pytest.mark.parametrize("sparse", [True, False])
def test_product_and_gradients_against_the_dense_product(sparse):
    v, u, d = 200, 24, 16
    P, keep = _sparse_rows(v, u, live=30)
    assert live_rows(P) is not None and live_rows(P).numel() <= 30  # the gathering path, not the dense fallback
    M = torch.randn(v, d, dtype=torch.float64)
    G = torch.randn(u, d, dtype=torch.float64)
    P1, M1 = P.clone().requires_grad_(), M.clone().requires_grad_()
    P2, M2 = P.clone().requires_grad_(), M.clone().requires_grad_()
    out = plan_product(P1, M1, sparse)
    ref = P2.t() @ M2
    assert torch.allclose(out, ref, atol=1e-13, rtol=0)
    out.backward(G)
    ref.backward(G)
    assert torch.allclose(M1.grad, M2.grad, atol=1e-13, rtol=0)  # dead rows of P: exactly 0 in both
    if sparse:  # the live rows exact, the dead rows (never read by the sparse kind) left at 0
        assert torch.allclose(P1.grad[keep], P2.grad[keep], atol=1e-13, rtol=0)
        assert P1.grad[~keep].abs().max() == 0 and P2.grad[~keep].abs().max() > 0
    else:
        assert torch.allclose(P1.grad, P2.grad, atol=1e-13, rtol=0)


def test_mostly_live_dense_plans_take_the_dense_product_and_dtypes_mix():
    v, u, d = 100, 8, 6
    P = torch.rand(v, u, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    P[:int(DENSE_FRACTION * v) - 10] = 0  # 60% of the rows live: the GEMMs
    assert live_rows(P) is None
    M = torch.randn(v, d, dtype=torch.bfloat16)  # a bf16 model's rows: cast as read, the result in P's dtype
    out = plan_product(P.float(), M)
    assert out.dtype == torch.float32
    assert torch.allclose(out, P.float().t() @ M.float(), atol=1e-5)
    P1 = P.float().requires_grad_()
    plan_product(P1, M, True).sum().backward()
    assert torch.allclose(P1.grad, M.float() @ torch.ones(u, d).t(), atol=1e-5)


def test_the_op_reads_nothing_back_as_the_counter_sees_it():
    """One dispatcher op per product (its CPU kernel's host read of P is no GPU stall; the CUDA kernels read
    nothing back): a stage-1 step that uses it still counts 0 (tests/stages/test_stage1_syncs.py)."""
    P, _ = _sparse_rows(300, 16, live=20)
    P.requires_grad_()
    M = torch.randn(300, 8, dtype=torch.float64)
    with count_host_syncs() as c:
        plan_product(P, M, True).sum().backward()
    assert c.total == 0, c.summary()


def _start(v, u, dead, seed):
    """A plan with dead source rows (mu = 0 there, as the shipped FVT start's own source marginal), C moved off it
    the way AdamW moves it: every entry of the support by +-lr, the zeros (no gradient) not at all."""
    g = torch.Generator().manual_seed(seed)
    P0 = torch.rand(v, u, generator=g, dtype=torch.float64) * (torch.rand(v, u, generator=g) < 0.5)
    P0[torch.randperm(v, generator=g)[:dead]] = 0
    P0[:, P0.sum(0) == 0] = 0  # (every column keeps mass below)
    P0[P0.sum(1).argmax(), :] += 1e-3
    P0 /= P0.sum()
    return P0, g


@pytest.mark.parametrize("floor", [0.0, 1.0])
@pytest.mark.parametrize("normalization,tied", [("convex", True), ("convex", False), ("paper", False)])
def test_translator_gradient_on_C_equals_the_dense_product(monkeypatch, floor, normalization, tied):
    """The sparse kind with dead rows: the live-row product gives C the dense product's gradient (float64).
    Where a row of mu = 0 does get mass (the column step's refill), it is live and its gradient is computed."""
    v, u, d = 120, 16, 12
    P0, g = _start(v, u, dead=70, seed=1)
    mu, nu = P0.sum(1), P0.sum(0)
    E = torch.randn(v, d, dtype=torch.float64, generator=g)
    L = E if tied else torch.randn(v, d, dtype=torch.float64, generator=g)
    G_E, G_L = torch.randn(u, d, dtype=torch.float64, generator=g), torch.randn(u, d, dtype=torch.float64, generator=g)
    move = 0.3 / v * torch.sign(torch.randn(v, u, dtype=torch.float64, generator=g))

    def grad(product):
        monkeypatch.setattr(module, "plan_product", product)
        tr = TokenTranslator(v, u, mu=mu, nu=nu, normalization=normalization, floor=floor, dtype=torch.float64)
        tr.init_from_dense(P0)
        with torch.no_grad():
            tr.C.add_(torch.where(P0 > 0, move, torch.zeros(())))
        E_new, L_new = tr.embed_and_head(E, L)
        torch.autograd.backward([E_new] + ([] if tied else [L_new]), [G_E] + ([] if tied else [G_L]))
        return tr.C.grad, tr.P().detach()

    g_live, P = grad(plan_product)
    g_dense, P_ref = grad(lambda P, M, sparse=False: P.t() @ M.to(P.dtype))
    assert torch.equal(P, P_ref)
    dead = int((P.abs().sum(1) == 0).sum())
    if floor:  # the floor drops the column step's refill: the 70 rows of mu = 0 stay dead, the gathering path runs
        assert dead == 70 and live_rows(P) is not None, dead
    else:  # without it a column left short refills ALL its zeros, dead rows included: every row live (dense path)
        assert dead == 0, dead
    assert g_dense.abs().max() > 0
    assert torch.allclose(g_live, g_dense, atol=1e-12, rtol=0), (g_live - g_dense).abs().max()


def _sharded_grad(v, u, d, dense):
    """On each rank: the sharded sparse translator from the dead-row start, floor 1; its block of C's gradient."""
    P0, g = _start(v, u, dead=70, seed=1)
    E = torch.randn(v, d, dtype=torch.float64, generator=g)
    G = torch.randn(u, d, dtype=torch.float64, generator=g)
    move = 0.3 / v * torch.sign(torch.randn(v, u, dtype=torch.float64, generator=g))
    group = dist.group.WORLD if dist.is_initialized() else None
    tr = TokenTranslator(v, u, mu=P0.sum(1), nu=P0.sum(0), floor=1.0, dtype=torch.float64, group=group)
    tr.init_from_dense(P0)
    with torch.no_grad():
        tr.C.add_(torch.where(P0 > 0, move, torch.zeros(()))[:, tr.col_start: tr.col_end])
    live_product = module.plan_product
    if dense:
        module.plan_product = lambda P, M, sparse=False: P.t() @ M.to(P.dtype)
    try:
        E_new, _ = tr.embed_and_head(E, E)
        E_new.backward(G)
    finally:
        module.plan_product = live_product
    with torch.no_grad():
        live = int(tr.P().any(1).sum())
    return tr.C.grad, live


def test_sharded_translator_with_dead_rows_equals_one_process_with_the_dense_product():
    """C's columns over 2 gloo ranks, each rank's block with its own live rows (gathered on each): the gradient is
    one process's with the dense product (float64)."""
    v, u, d = 120, 16, 12
    res = run_distributed(_sharded_grad, 2, v, u, d, False, timeout=120)
    G = torch.cat([r[0] for r in res], 1)
    ref, live = _sharded_grad(v, u, d, True)
    assert all(r[1] <= 50 for r in res) and live <= 50, ([r[1] for r in res], live)  # the gathering path ran
    assert ref.abs().max() > 0
    assert torch.allclose(G, ref, atol=1e-11, rtol=0), (G - ref).abs().max()


@pytest.mark.slow
def test_bench_plan_product_runs_as_typed():
    """bench/bench_plan_product.py at a small width on CPU, the shipped plan (the moved uniform plan, every row live,
    is for a GPU: the CPU Sinkhorn is exact, not fast): its row printed, few live rows, the gathered rows taken, and
    C's gradient the same from the op and from the dense product."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "bench.bench_plan_product", "--d", "64",
                           "--reps", "1", "--plans", "shipped"], env=env, capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| shipped") or line.startswith("| moved")}
    assert set(rows) == {"shipped"}, proc.stdout
    assert 0 < int(rows["shipped"][1]) < 2000
    assert rows["shipped"][5] == "live rows", rows
    for cells in rows.values():
        diff, of = cells[4].split(" (of ")
        assert float(diff) <= 1e-6 * float(of.rstrip(")")), cells
