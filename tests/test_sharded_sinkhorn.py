"""Column-sharded sparse Sinkhorn on gloo: P and gradients equal the single-process ones (2 and 3 ranks, even and
uneven shards, both row-projection methods, every threshold path); bytes sent; the run_distributed helper."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import DistributedTestError, run_distributed
from s2t2_dist.distributed.sharded_sinkhorn import ShardedSparseSinkhorn, shard_bounds, sharded_softmax_sinkhorn
from s2t2_dist.ot.simplex import DEFAULT_WARM_ITERS
from s2t2_dist.ot.sinkhorn import softmax_sinkhorn, sparse_sinkhorn

# (v, u, noise, seed, method, row_k, n_iter): moved C, the paper's init (all ties: full supports), big noise,
# tiny row_k (a poor starting bound: more Newton passes, with all-reduced partials)
CASES = [
    # a moved plan of the demo's size: 6 Newton passes + the fallback left hundreds of rows unproven here
    (512, 512, 1e-3, 4, "threshold", 8, 3),
    (300, 41, 1e-3, 0, "threshold", 8, 3),
    (300, 41, 1e-3, 0, "alltoall", 8, 3),
    (200, 40, 0.0, 1, "threshold", 8, 3),
    (120, 30, 1.0, 2, "threshold", 8, 4),
    (150, 37, 0.3, 3, "threshold", 1, 3),
    (150, 37, 0.3, 3, "alltoall", 1, 3),
    (90, 25, 3e-2, 4, "threshold", 2, 5),
]


def _problem(v, u, noise, seed):
    g = torch.Generator().manual_seed(seed)
    C = torch.full((v, u), 1.0 / v, dtype=torch.float64) + noise * torch.randn(v, u, generator=g, dtype=torch.float64)
    mu = torch.rand(v, generator=g, dtype=torch.float64) + 0.5
    nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.5
    up = torch.randn(v, u, generator=g, dtype=torch.float64)
    return C, mu / mu.sum(), nu / nu.sum(), up


def _sharded_cases(cases):
    rank, R = dist.get_rank(), dist.get_world_size()
    out = []
    for v, u, noise, seed, method, row_k, n_iter in cases:
        C, mu, nu, up = _problem(v, u, noise, seed)
        a, b = shard_bounds(u, R, rank)
        solver = ShardedSparseSinkhorn(mu, nu[a:b], u, method=method, row_k=row_k)
        res = []
        for call in range(2):  # a second call of the same solver
            Cl = (C[:, a:b] + call * 1e-3 * up[:, a:b]).clone().requires_grad_(True)
            solver.stats.reset()
            P = solver(Cl, n_iter)
            fwd_bytes = solver.stats.bytes_sent
            (P * up[:, a:b]).sum().backward()
            res.append((P.detach(), Cl.grad, fwd_bytes, solver.stats.bytes_sent - fwd_bytes))
        out.append(res)
        # softmax baseline, sharded (autograd through the distributed row softmax)
    C, mu, nu, up = _problem(60, 13, 0.5, 9)
    a, b = shard_bounds(13, R, rank)
    Cl = C[:, a:b].clone().requires_grad_(True)
    Ps = sharded_softmax_sinkhorn(Cl, mu, nu[a:b], n_iter=3)
    (Ps * up[:, a:b]).sum().backward()
    return out, (Ps.detach(), Cl.grad)


def _single(case, call):
    v, u, noise, seed, method, row_k, n_iter = case
    C, mu, nu, up = _problem(v, u, noise, seed)
    Cg = (C + call * 1e-3 * up).clone().requires_grad_(True)
    P = sparse_sinkhorn(Cg, mu, nu, n_iter, row_k=row_k)
    (P * up).sum().backward()
    return P.detach(), Cg.grad


@pytest.fixture(scope="module")
def single():
    ref = {(i, c): _single(case, c) for i, case in enumerate(CASES) for c in range(2)}
    C, mu, nu, up = _problem(60, 13, 0.5, 9)
    Cg = C.clone().requires_grad_(True)
    P = softmax_sinkhorn(Cg, mu, nu, 3)
    (P * up).sum().backward()
    return ref, (P.detach(), Cg.grad)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_equals_single_process(world, single):
    ref, soft = single
    results = run_distributed(_sharded_cases, world, CASES, timeout=120)
    bytes_table = []
    for i, case in enumerate(CASES):
        for call in range(2):
            P_ref, g_ref = ref[(i, call)]
            P = torch.cat([results[r][0][i][call][0] for r in range(world)], 1)
            G = torch.cat([results[r][0][i][call][1] for r in range(world)], 1)
            assert torch.allclose(P, P_ref, atol=1e-13, rtol=0), (case, call, (P - P_ref).abs().max())
            assert torch.allclose(G, g_ref, atol=1e-11, rtol=0), (case, call, (G - g_ref).abs().max())
        fwd, bwd = results[0][0][i][1][2], results[0][0][i][1][3]
        bytes_table.append((case, fwd, bwd))
        if world == 1:
            assert fwd == 0 and bwd == 0
    Ps = torch.cat([results[r][1][0] for r in range(world)], 1)
    Gs = torch.cat([results[r][1][1] for r in range(world)], 1)
    assert torch.allclose(Ps, soft[0], atol=1e-14) and torch.allclose(Gs, soft[1], atol=1e-12)
    if world > 1:
        print()
        for (v, u, noise, seed, method, row_k, n_iter), fwd, bwd in bytes_table:
            full = v * u * 8  # float64 here
            print(f"R={world} v={v} u={u} noise={noise} {method:9s} row_k={row_k}: sent/iteration/rank fwd "
                  f"{fwd / n_iter:.0f} B, bwd {bwd / n_iter:.0f} B; gathering C would be {full} B")


def _bytes_worker(v, u, method):
    rank, R = dist.get_rank(), dist.get_world_size()
    C = torch.full((v, u), 1.0 / v) + 1e-3 * torch.randn(v, u, generator=torch.Generator().manual_seed(0))
    a, b = shard_bounds(u, R, rank)
    # sort_max=0: the Newton passes whose traffic this measures (what runs above SORT_MAX_ENTRIES; below it the
    # threshold method gathers the rows whole)
    solver = ShardedSparseSinkhorn(torch.full((v,), 1.0 / v), torch.full((b - a,), 1.0 / u), u, method=method,
                                   validate=False, sort_max=0)
    out = []
    for call in range(2):
        solver.stats.reset()
        Cl = C[:, a:b].clone().requires_grad_(True)
        P = solver(Cl, 3)
        fwd = solver.stats.bytes_sent
        P.sum().backward()
        out.append((fwd, solver.stats.bytes_sent - fwd))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_threshold_vs_alltoall(world):
    """Per Dykstra iteration and rank, the threshold method sends O(v * k) bytes, the transpose O(v * u / R)."""
    v, u = 1000, 600
    thr = run_distributed(_bytes_worker, world, v, u, "threshold")
    a2a = run_distributed(_bytes_worker, world, v, u, "alltoall")
    full = v * u * 4
    print(f"\nR={world} v={v} u={u} float32, bytes sent per iteration by rank 0 (fwd, bwd), two calls: "
          f"threshold {[(f // 3, b // 3) for f, b in thr[0]]}, alltoall {[(f // 3, b // 3) for f, b in a2a[0]]}, "
          f"all of C: {full}")
    for r in range(world):
        (fc, bc), (fw, bw) = thr[r]
        assert fw < a2a[r][1][0] / 5  # far less than the transpose
        assert fw / 3 < full / 20 and bw / 3 < full / 100
        assert bw == a2a[r][1][1]  # same backward: one all-reduce of per-row sums per row projection


def _sync_worker(v, u, method):
    from s2t2_dist.utils.syncs import count_host_syncs

    rank, R = dist.get_rank(), dist.get_world_size()
    C = torch.full((v, u), 1.0 / v) + 1e-3 * torch.randn(v, u, generator=torch.Generator().manual_seed(0))
    a, b = shard_bounds(u, R, rank)
    solver = ShardedSparseSinkhorn(torch.full((v,), 1.0 / v), torch.full((b - a,), 1.0 / u), u, method=method)
    solver(C[:, a:b], 1)  # the first call validates (host reads and a collective, once)
    Cl = C[:, a:b].clone().requires_grad_(True)
    with count_host_syncs() as c:
        solver(Cl, 3).backward(torch.ones(v, b - a))
    return dict(c.counts), int(solver.rows.unproven)


@pytest.mark.parametrize("method", ["threshold", "alltoall"])
def test_no_host_syncs_on_two_ranks(method):
    """Forward + backward of the column-sharded Sinkhorn reads nothing back to the host (collectives on CPU
    tensors are not host reads; only the listed ops count)."""
    for counts, unproven in run_distributed(_sync_worker, 2, 4000, 64, method, timeout=120):
        assert counts == {} and unproven == 0, counts


def _bad_rank_worker():
    rank = dist.get_rank()
    C = torch.full((20, 3), 1.0 / 20)
    if rank == 1:
        C[4, 0] = float("nan")
    a, b = shard_bounds(6, dist.get_world_size(), rank)
    solver = ShardedSparseSinkhorn(torch.full((20,), 1 / 20), torch.full((b - a,), 1 / 6), 6)
    return solver(C[:, : b - a], 3)


def test_validation_error_on_one_rank_raises_everywhere():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="C must be finite|another rank's inputs failed"):
        run_distributed(_bad_rank_worker, 2, timeout=60)
    assert time.monotonic() - t0 < 120  # no hang (generous: the machine may be heavily loaded)


def test_shard_bounds():
    for u in (1, 7, 512, 4097):
        for R in (1, 2, 3, 4, 7):
            if u < R:
                continue
            b = [shard_bounds(u, R, r) for r in range(R)]
            assert b[0][0] == 0 and b[-1][1] == u
            assert all(b[r][1] == b[r + 1][0] for r in range(R - 1))
            sizes = [e - s for s, e in b]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        shard_bounds(10, 2, 2)


# ---------------------------------------------------------------------------------------------- the helper itself
def _rank_times(x):
    return dist.get_rank() * x, os.environ["RANK"], dist.get_world_size()


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ZeroDivisionError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever without the helper's clean-up
    return "unreachable"


def _hang_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(600)
    return 1


def _die_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(600)


def test_run_distributed_helper():
    assert run_distributed(_rank_times, 3, 10) == [(0, "0", 3), (10, "1", 3), (20, "2", 3)]
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 raised.*ZeroDivisionError: boom on purpose"):
        run_distributed(_raise_on_rank1, 2, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"timed out after 5 s waiting for rank\(s\) \[0"):
        run_distributed(_hang_on_rank0, 2, timeout=5)
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[1\] exited with code\(s\) \[3\]"):
        run_distributed(_die_on_rank1, 2, timeout=60)
    assert time.monotonic() - t0 < 120  # no hang (generous: the machine may be heavily loaded)


def _fused_worker(method):
    from s2t2_dist.ot.fused import FusedKernels
    from s2t2_dist.utils.syncs import count_host_syncs

    rank, R = dist.get_rank(), dist.get_world_size()
    v, u, noise, seed = 150, 37, 0.3, 3
    C, mu, nu, up = _problem(v, u, noise, seed)
    a, b = shard_bounds(u, R, rank)
    kern = FusedKernels()
    solver = ShardedSparseSinkhorn(mu, nu[a:b], u, method=method, fused=kern)
    out = []
    for call in range(2):  # cold, then warm
        Cl = (C[:, a:b] + call * 1e-3 * up[:, a:b]).clone().requires_grad_(True)
        P = solver(Cl, 3)
        (P * up[:, a:b]).sum().backward()
        out.append((P.detach(), Cl.grad))
    Cl = C[:, a:b].clone().requires_grad_(True)
    with count_host_syncs() as c:
        solver(Cl, 3).backward(up[:, a:b])
    return out, dict(c.counts), int(solver.rows.unproven) + int(solver.cols.unproven), kern.calls


@pytest.mark.parametrize("method", ["threshold", "alltoall"])
def test_sharded_fused_kernels_equal_single_process(method):
    """Compiled pass kernels on 2 gloo ranks (per-pass partials all-reduced between kernels): P and dC equal the
    single-process eager result (float64), warm and cold, with no host syncs."""
    v, u, noise, seed = 150, 37, 0.3, 3
    results = run_distributed(_fused_worker, 2, method, timeout=300)
    C, mu, nu, up = _problem(v, u, noise, seed)
    for call in range(2):
        Cg = (C + call * 1e-3 * up).clone().requires_grad_(True)
        P_ref = sparse_sinkhorn(Cg, mu, nu, 3, fused=False)
        (P_ref * up).sum().backward()
        P = torch.cat([results[r][0][call][0] for r in range(2)], 1)
        G = torch.cat([results[r][0][call][1] for r in range(2)], 1)
        assert torch.allclose(P, P_ref, atol=1e-13, rtol=0), (P - P_ref).abs().max()
        assert torch.allclose(G, Cg.grad, atol=1e-11, rtol=0), (G - Cg.grad).abs().max()
    for _, counts, unproven, calls in results:
        assert counts == {} and unproven == 0 and calls > 0, (counts, unproven, calls)


def _warm_sharded(method):
    rank, R = dist.get_rank(), dist.get_world_size()
    C, mu, nu, up = _problem(300, 41, 1e-3, 21)
    a, b = shard_bounds(41, R, rank)
    # sort_max=0: the Newton passes (and so the warm starts) at this size
    solver = ShardedSparseSinkhorn(mu, nu[a:b], 41, method=method, validate=False, sort_max=0)
    rows = solver.rows.local if method == "alltoall" else solver.rows
    rows.warm_iters = solver.cols.warm_iters = DEFAULT_WARM_ITERS  # opted in (off by default)
    out = []
    for call in range(3):
        Cl = (C[:, a:b] + call * 1e-5 * up[:, a:b]).clone().requires_grad_(True)
        P = solver(Cl, 3)
        (P * up[:, a:b]).sum().backward()
        out.append((P.detach(), Cl.grad))
    return out, sorted(rows._warm), sorted(solver.cols._warm), int(solver.unproven())


@pytest.mark.parametrize("method", ["threshold", "alltoall"])
def test_sharded_warm_starts_equal_single_process(method):
    """Column-sharded over 2 ranks, opted in, the second and third calls start from the previous thresholds (each pass's
    partials all-reduced as in a cold start) and still give the single-process sort reference's P and dC."""
    results = run_distributed(_warm_sharded, 2, method, timeout=120)
    C, mu, nu, up = _problem(300, 41, 1e-3, 21)
    for call in range(3):
        Cg = (C + call * 1e-5 * up).clone().requires_grad_(True)
        P_ref = sparse_sinkhorn(Cg, mu, nu, 3)  # sorted thresholds: exact
        (P_ref * up).sum().backward()
        P = torch.cat([results[r][0][call][0] for r in range(2)], 1)
        G = torch.cat([results[r][0][call][1] for r in range(2)], 1)
        assert torch.allclose(P, P_ref, atol=1e-13, rtol=0), (call, (P - P_ref).abs().max())
        assert torch.allclose(G, Cg.grad, atol=1e-11, rtol=0), (call, (G - Cg.grad).abs().max())
    for r in range(2):
        assert results[r][1] == results[r][2] == [0, 1, 2] and results[r][3] == 0
