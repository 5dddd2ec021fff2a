"""Column-sharded sparse Sinkhorn on gloo: P and gradients equal the single-process ones (2 and 3 ranks, even and
uneven shards); bytes sent; no host reads; the run_distributed helper."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import DistributedTestError, run_distributed
from s2t2_dist.distributed.sharded_sinkhorn import ShardedSparseSinkhorn, shard_bounds, sharded_softmax_sinkhorn
from s2t2_dist.ot.sinkhorn import softmax_sinkhorn, sparse_sinkhorn

# (v, u, noise, seed, n_iter): moved C (the demo's size), the paper's init (all ties: full supports), big noise,
# uneven shards
CASES = [
    (512, 512, 1e-3, 4, 3),
    (300, 41, 1e-3, 0, 3),
    (200, 40, 0.0, 1, 3),
    (120, 30, 1.0, 2, 4),
    (150, 37, 0.3, 3, 3),
    (90, 25, 3e-2, 4, 5),
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
    for v, u, noise, seed, n_iter in cases:
        C, mu, nu, up = _problem(v, u, noise, seed)
        a, b = shard_bounds(u, R, rank)
        solver = ShardedSparseSinkhorn(mu, nu[a:b], u)
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
    v, u, noise, seed, n_iter = case
    C, mu, nu, up = _problem(v, u, noise, seed)
    Cg = (C + call * 1e-3 * up).clone().requires_grad_(True)
    P = sparse_sinkhorn(Cg, mu, nu, n_iter)
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
        for (v, u, noise, seed, n_iter), fwd, bwd in bytes_table:
            full = v * u * 8  # float64 here
            print(f"R={world} v={v} u={u} noise={noise}: sent/iteration/rank fwd "
                  f"{fwd / n_iter:.0f} B, bwd {bwd / n_iter:.0f} B; gathering C would be {full} B")


def _bytes_worker(v, u):
    rank, R = dist.get_rank(), dist.get_world_size()
    C = torch.full((v, u), 1.0 / v) + 1e-3 * torch.randn(v, u, generator=torch.Generator().manual_seed(0))
    a, b = shard_bounds(u, R, rank)
    solver = ShardedSparseSinkhorn(torch.full((v,), 1.0 / v), torch.full((b - a,), 1.0 / u), u, validate=False)
    out = []
    for call in range(2):
        solver.stats.reset()
        Cl = C[:, a:b].clone().requires_grad_(True)
        P = solver(Cl, 3)
        fwd, calls = solver.stats.bytes_sent, dict(solver.stats.calls)
        P.sum().backward()
        out.append((fwd, solver.stats.bytes_sent - fwd, calls))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_and_collectives_per_row_projection(world):
    """Per row projection and rank: one all_to_all sending the other ranks their rows of this rank's block (about
    (R-1)/R of it) and one all_gather of v (threshold, count) pairs; backward: one all-reduce of v per-row sums."""
    v, u = 1000, 600
    res = run_distributed(_bytes_worker, world, v, u)
    for r in range(world):
        a, b = shard_bounds(u, world, r)
        for fwd, bwd, calls in res[r]:
            assert calls == {"all_to_all": 3, "all_gather": 3}, calls
            rows_kept = (lambda s, e: e - s)(*shard_bounds(v, world, r))
            a2a = (v - rows_kept) * (b - a) * 4
            gather = (world - 1) * -(-v // world) * 2 * 8
            assert fwd == 3 * (a2a + gather), (fwd, a2a, gather)
            assert bwd == 3 * int(2 * (world - 1) / world * v * 4), bwd  # (the columns' backward is local)
    print(f"\nR={world} v={v} u={u} float32, bytes sent per iteration by rank 0 (fwd, bwd): "
          f"{[(f // 3, b_ // 3) for f, b_, _ in res[0]]}; all of C: {v * u * 4}")


def _sync_worker(v, u):
    from s2t2_dist.utils.syncs import count_host_syncs

    rank, R = dist.get_rank(), dist.get_world_size()
    C = torch.full((v, u), 1.0 / v) + 1e-3 * torch.randn(v, u, generator=torch.Generator().manual_seed(0))
    a, b = shard_bounds(u, R, rank)
    solver = ShardedSparseSinkhorn(torch.full((v,), 1.0 / v), torch.full((b - a,), 1.0 / u), u)
    solver(C[:, a:b], 1)  # the first call validates (host reads and a collective, once)
    Cl = C[:, a:b].clone().requires_grad_(True)
    with count_host_syncs() as c:
        solver(Cl, 3).backward(torch.ones(v, b - a))
    return dict(c.counts)


def test_no_host_syncs_on_two_ranks():
    """Forward + backward of the column-sharded Sinkhorn reads nothing back to the host (collectives on CPU
    tensors are not host reads; only the listed ops count)."""
    for counts in run_distributed(_sync_worker, 2, 4000, 64, timeout=120):
        assert counts == {}, counts


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


def _route_worker(fail_rank):
    """Every rank on a 'kernel device' whose kernels (here the torch steps under another name) pass their check,
    but for `fail_rank`'s, made to fail: the route each rank then takes."""
    import s2t2_dist.ot.dykstra as dy
    import s2t2_dist.ot.routing as ro
    import s2t2_dist.ot.dykstra_triton as dt
    from s2t2_dist.utils import routes

    class StandInKernels(dy.TorchSteps):
        pass

    r, R = dist.get_rank(), dist.get_world_size()
    ro.kernel_device = lambda device: True
    dt.TritonSteps = StandInKernels
    ro.kernels_why_not = lambda device, shape, dtype=None: (
        f"failed their first-use check at {shape[0]} x {shape[1]} float32: made to fail" if r == fail_rank else "")
    routes.ROUTES.clear()
    C, mu, nu, up = _problem(120, 30, 1e-2, 0)
    a, b = shard_bounds(30, R, r)
    solver = ShardedSparseSinkhorn(mu, nu[a:b], 30)
    P = solver(C[:, a:b].clone(), 3)
    return routes.summary()["sinkhorn"], type(solver._steps.local).__name__, float(P.sum())


@pytest.mark.parametrize("ranks", [2, 3])
def test_one_route_for_the_job_when_one_ranks_check_fails(ranks):
    """Rank 1's kernels refused, the others' not: every rank takes the torch steps and says which rank and why;
    with no rank refused, every rank keeps the kernels."""
    res = run_distributed(_route_worker, ranks, 1, timeout=120)
    assert [kind for _, kind, _ in res] == ["TorchSteps"] * ranks
    for r, (route, _, _) in enumerate(res):
        assert route["route"] == "torch steps" and route["fallback"], route
        if r != 1:
            assert route["why"].startswith("one route for the job: rank 1's the Triton kernels failed their "
                                           "first-use check at "), route
    res = run_distributed(_route_worker, ranks, None, timeout=120)
    assert [kind for _, kind, _ in res] == ["StandInKernels"] * ranks
    assert all(route["route"] == "kernels" and not route["fallback"] for route, _, _ in res)


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
