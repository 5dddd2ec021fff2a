"""The C kernels of the sparse Sinkhorn (``s2t2_dist/ot/native.py``): exact against the sort reference, equal to
the eager path, pooled results that never alias a live one, the reference under the host-sync counter, the
column-sharded solver on 2 gloo ranks, the unproven count, and the build (cached, concurrent, and a fallback when
it cannot be built)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from s2t2_dist.distributed.sharded_sinkhorn import ShardedSparseSinkhorn, shard_bounds
from s2t2_dist.ot import native
from s2t2_dist.ot.native import NativeKernels
from s2t2_dist.ot.sinkhorn import SparseSinkhorn, sparse_sinkhorn
from test_sinkhorn import _assert_equals_sort_reference, _edge_problem, _problem

pytestmark = pytest.mark.skipif(not native.native_available(), reason="no C compiler")  # CI has one: see below


def test_ci_builds_the_kernels():
    """CI has a C compiler: the C path must be the one these tests exercise, not skipped."""
    assert native.library() is not None


# shapes off the vector widths (16 float32 / 8 float64 lanes) and the 64-row chunks, ties, large supports
CASES = [(30, 7, 1e-2, False), (200, 40, 1e-2, True), (120, 33, 0.0, False), (500, 64, 1e-3, False),
         (50, 300, 1.0, True), (64, 9, 1e-4, True), (300, 512, 1e-3, False), (513, 129, 3e-3, True)]


@pytest.mark.parametrize("v,u,noise,nonuni", CASES)
def test_native_equals_sort_reference(v, u, noise, nonuni):
    """P and dC of the C kernels (float64) equal autograd through the sort-based reference (1e-12), twice through one
    solver (its pooled buffers), with every threshold proven."""
    C, mu, nu = _problem(v, u, noise, seed=v + u, nonuniform=nonuni)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    solver = SparseSinkhorn(mu, nu, fused="native")
    for _ in range(2):
        _assert_equals_sort_reference(solver, C, mu, nu, up)
    assert isinstance(solver.rows.kernels, NativeKernels) and solver.rows.kernels.native_calls == 4
    assert int(solver.unproven()) == 0


@pytest.mark.parametrize("case", ["edge", "init", "moved"])
def test_native_exact_on_edge_cases(case):
    """Ties, all-equal blocks, one-hot and very negative rows and columns, zero marginals."""
    if case == "edge":
        C, mu, nu = _edge_problem()
    else:
        C, mu, nu = _problem(200, 40, 0.0 if case == "init" else 3e-3, seed=12, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    solver = SparseSinkhorn(mu, nu, fused="native")
    _assert_equals_sort_reference(solver, C, mu, nu, up)
    assert int(solver.unproven()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_float32_has_the_eager_supports(dtype):
    """In float32 (and from a bfloat16 C, computed in float32) the C kernels find the eager path's supports, and its
    values and gradient up to the order of the sums; drop_below as well."""
    C, mu, nu = _problem(700, 200, 2e-3, seed=5, dtype=torch.float32, nonuniform=True)
    C = C.to(dtype)
    up = torch.randn(C.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    drop = torch.full((200,), 1e-6)
    out = {}
    for fused in ("native", False):
        Cg = C.clone().requires_grad_(True)
        P = SparseSinkhorn(mu, nu, fused=fused)(Cg, 3, drop_below=drop)
        (P.float() * up.float()).sum().backward()
        out[fused] = (P.detach().float(), Cg.grad.float())
    (Pn, gn), (Pe, ge) = out["native"], out[False]
    assert torch.equal(Pn > 0, Pe > 0)
    torch.testing.assert_close(Pn, Pe, rtol=1e-4 if dtype == torch.float32 else 1e-2, atol=1e-9)
    torch.testing.assert_close(gn, ge, rtol=1e-3, atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_pooled_results_never_alias_a_live_one():
    """The solver hands a result's storage out again only once every tensor on it was dropped: a held P and dC keep
    their values through later calls; a dropped one's storage is reused (no fresh 100 MB of page faults)."""
    C, mu, nu = _problem(300, 40, 3e-3, seed=21, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    solver = SparseSinkhorn(mu, nu, fused="native")

    def call(c):
        Cg = c.clone().requires_grad_(True)
        P = solver(Cg, 3)
        P.backward(up)
        return P.detach(), Cg.grad

    P1, g1 = call(C)
    keep = (P1.clone(), g1.clone())
    view = P1[:, :5]  # a view keeps the storage alive too
    del P1
    P2, g2 = call(C + 1e-3 * up)
    assert len({view.data_ptr(), P2.data_ptr(), g1.data_ptr(), g2.data_ptr()}) == 4
    assert torch.equal(view, keep[0][:, :5]) and torch.equal(g1, keep[1])
    ptrs = (P2.data_ptr(), g2.data_ptr())
    del P2, g2
    P3, g3 = call(C)
    assert (P3.data_ptr(), g3.data_ptr()) == ptrs  # dropped results' storages are reused
    assert torch.equal(view, keep[0][:, :5]) and torch.equal(g1, keep[1])
    torch.testing.assert_close(P3, keep[0], rtol=0, atol=1e-15)
    torch.testing.assert_close(g3, keep[1], rtol=0, atol=1e-13)


def test_under_the_sync_counter_the_reference_runs():
    """Under a TorchDispatchMode the solver runs the reference ops (what the counter counts: none are host syncs),
    on the same supports; outside it, the C kernels."""
    from s2t2_dist.utils.syncs import count_host_syncs

    C, mu, nu = _problem(400, 70, 1e-3, seed=6, dtype=torch.float32)
    up = torch.randn(C.shape, generator=torch.Generator().manual_seed(4))
    solver = SparseSinkhorn(mu, nu, fused="native")
    solver(C, 1)  # validation reads mu and nu once
    kern = solver.rows.kernels
    before = kern.native_calls
    Cg = C.clone().requires_grad_(True)
    with count_host_syncs() as cnt:
        P = solver(Cg, 3)
        P.backward(up)
    assert cnt.total == 0, cnt.summary()
    assert kern.native_calls == before
    Cn = C.clone().requires_grad_(True)
    Pn = solver(Cn, 3)
    Pn.backward(up)
    assert kern.native_calls == before + 2
    assert torch.equal(P > 0, Pn > 0)
    torch.testing.assert_close(Cg.grad, Cn.grad, rtol=1e-4, atol=1e-6)


def test_forward_native_backward_under_the_counter():
    """A forward by the C kernels whose backward runs under the counter takes the reference backward on the
    supports the kernels saved: the same gradient."""
    from s2t2_dist.utils.syncs import count_host_syncs

    C, mu, nu = _problem(200, 40, 3e-3, seed=7, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    grads = []
    for counted in (False, True):
        Cg = C.clone().requires_grad_(True)
        P = SparseSinkhorn(mu, nu, fused="native")(Cg, 3)
        if counted:
            with count_host_syncs() as cnt:
                P.backward(up)
            assert cnt.total == 0
        else:
            P.backward(up)
        grads.append(Cg.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-13)


def test_unproven_thresholds_are_counted(monkeypatch):
    """A pass budget too small to prove the thresholds leaves them lower bounds, counted in ``unproven`` (as on the
    fixed-pass path); the shipped budget proves them all."""
    C, mu, nu = _problem(300, 64, 1e-3, seed=9, nonuniform=True)
    monkeypatch.setattr(native, "MAX_PASSES", 1)
    s = SparseSinkhorn(mu, nu, fused="native")
    s(C, 3)
    assert int(s.unproven()) > 0
    monkeypatch.setattr(native, "MAX_PASSES", 32)
    s = SparseSinkhorn(mu, nu, fused="native")
    s(C, 3)
    assert int(s.unproven()) == 0


def test_auto_picks_the_c_kernels_for_large_plans_only():
    """``fused="auto"`` (the default) takes the C kernels on CPU from FUSED_MIN_NUMEL entries, and nothing below."""
    from s2t2_dist.ot.fused import FUSED_MIN_NUMEL
    from s2t2_dist.ot.native import resolve_fused

    assert isinstance(resolve_fused("auto", torch.device("cpu"), FUSED_MIN_NUMEL), NativeKernels)
    assert resolve_fused("auto", torch.device("cpu"), FUSED_MIN_NUMEL - 1) is None
    assert not isinstance(resolve_fused(True, torch.device("cpu"), FUSED_MIN_NUMEL), NativeKernels)
    with pytest.raises(ValueError, match="native"):
        resolve_fused("fast", torch.device("cpu"), 10)


def _native_sharded_worker():
    rank, R = dist.get_rank(), dist.get_world_size()
    from test_sharded_sinkhorn import _problem as sharded_problem

    C, mu, nu, up = sharded_problem(150, 37, 0.3, 3)
    a, b = shard_bounds(37, R, rank)
    solver = ShardedSparseSinkhorn(mu, nu[a:b], 37, fused="native")
    out = []
    for call in range(2):
        Cl = (C[:, a:b] + call * 1e-3 * up[:, a:b]).clone().requires_grad_(True)
        P = solver(Cl, 3)
        (P * up[:, a:b]).sum().backward()
        out.append((P.detach(), Cl.grad))
    return out, solver.cols.kernels.native_calls, int(solver.rows.unproven) + int(solver.cols.unproven)


def test_sharded_columns_take_the_c_kernels():
    """On 2 gloo ranks (C's columns sharded, rows spanning ranks) the column projections run in C and the rows by
    the all-reduced passes: P and dC equal the single-process eager result (float64)."""
    from test_sharded_sinkhorn import _problem as sharded_problem

    results = run_distributed(_native_sharded_worker, 2, timeout=300)
    C, mu, nu, up = sharded_problem(150, 37, 0.3, 3)
    for call in range(2):
        Cg = (C + call * 1e-3 * up).clone().requires_grad_(True)
        P_ref = sparse_sinkhorn(Cg, mu, nu, 3, fused=False)
        (P_ref * up).sum().backward()
        P = torch.cat([results[r][0][call][0] for r in range(2)], 1)
        G = torch.cat([results[r][0][call][1] for r in range(2)], 1)
        assert torch.allclose(P, P_ref, atol=1e-13, rtol=0), (P - P_ref).abs().max()
        assert torch.allclose(G, Cg.grad, atol=1e-11, rtol=0), (G - Cg.grad).abs().max()
    for _, calls, unproven in results:
        assert calls == 2 * 2 * 3 and unproven == 0, (calls, unproven)  # 3 column steps + 3 backwards per call


_BUILD = textwrap.dedent("""
    import warnings, torch
    warnings.simplefilter("always")
    from s2t2_dist.ot import native
    from s2t2_dist.ot.sinkhorn import sparse_sinkhorn
    lib = native.library()
    C = torch.rand(80, 20, dtype=torch.float64)
    P = sparse_sinkhorn(C, torch.full((80,), 1 / 80, dtype=torch.float64), torch.full((20,), 1 / 20,
                        dtype=torch.float64), 3, fused="native")
    print("LIB", lib is not None, "SUM", round(float(P.sum()), 9))
""")


def _build(tmp_path, **env):
    e = dict(os.environ, S2T2_NATIVE_CACHE=str(tmp_path / "cache"), **env)
    return subprocess.Popen([sys.executable, "-c", _BUILD], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_build_is_cached_and_safe_to_race(tmp_path):
    """Two processes building into an empty cache at once both load a working library; one file is left, no temp."""
    procs = [_build(tmp_path) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "LIB True SUM 1.0" in out, (out, err)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 1 and files[0].endswith(".so"), files


@pytest.mark.parametrize("env,warns", [({"S2T2_NATIVE": "0"}, False), ({"CC": "false"}, True)])
def test_without_the_kernels_the_compiled_passes_run(tmp_path, env, warns):
    """``S2T2_NATIVE=0`` turns the C kernels off quietly; a compiler that fails warns once; either way the solver
    gives the same plan by the other kernels."""
    p = _build(tmp_path, **env)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "LIB False SUM 1.0" in out, (out, err)
    assert ("could not build" in err) == warns, err
