"""The sparse Sinkhorn's CUDA route (ot/dykstra_triton.py + ot/triton_kernels.py) on a CPU, by Triton's interpreter.

Not collected by itself (not test_*.py): tests/ot/test_gpu_kernels.py runs it in a pytest of its own with
TRITON_INTERPRET=1 in the environment from the start (Triton reads the switch when the kernels are defined).
The route is taken by building its steps directly (on a CPU tensor ``steps_for`` gives the torch steps).
"""
import os

import pytest
import torch
import torch.distributed as dist

import s2t2_dist.ot.dykstra_triton as dt
from tests.helpers.distributed import run_distributed
from s2t2_dist.distributed.sharded_sinkhorn import GroupComm, ShardedSteps, shard_bounds
from s2t2_dist.ot.dykstra import dykstra
from s2t2_dist.ot.dykstra_triton import TritonSteps, dry_run
from s2t2_dist.utils.syncs import count_host_syncs
from tests.helpers.sinkhorn_reference import assert_equals_reference, edge_problem, problem, sort_thresholds

assert os.environ.get("TRITON_INTERPRET") == "1"

CASES = [(30, 7, 1e-2, False), (200, 40, 1e-2, True), (120, 33, 0.0, False), (50, 300, 1.0, True),
         (64, 9, 1e-4, True), (97, 130, 3e-3, False)]


#: the tiles the interpreted tests run with: the interpreter runs a program's ops one by one, so its time follows
#: the number of programs, 4x as many at the shipped 2,048-entry tiles as at these; the kernels take the same
#: branches (several slices a program in registers, streamed slices), and test_shipped_tiles runs the shipped ones
FAST_TILES = {"ROW_TILE": 8192, "BLOCK_N": 4096, "MIN_ROWS": 16}


@pytest.fixture(autouse=True)
def fast_tiles(request, monkeypatch):
    if "shipped" not in request.node.name:
        for k, val in FAST_TILES.items():
            monkeypatch.setattr(dt, k, val)


def test_shipped_tiles():
    """The shipped tiling (rows 4 a program at u = 512, rows of 3,000 streamed in chunks of 2,048): exact."""
    assert (dt.ROW_TILE, dt.BLOCK_N, dt.MIN_ROWS) == (2048, 2048, 4)
    assert dt._shape(40, 512) == (4, 512, True) and dt._shape(5, 3000) == (1, 2048, False)
    colmajor = torch.empty_strided((40, 700), (1, 40))
    assert dt._shape(40, 700, 1, colmajor) == (32, 32, False)  # long strided rows: 32 a program, chunks of 32
    assert dt._shape(40, 700, 1, colmajor.contiguous()) == (1, 2048, True)  # contiguous rows: one a program
    for v, u in ((40, 512), (3000, 5), (40, 700)):
        C, mu, nu = problem(v, u, 1e-2, seed=v, nonuniform=True, dtype=torch.float32)
        up = torch.randn(v, u, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
        assert_equals_reference(lambda c: dykstra(c, TritonSteps(mu, nu), 2), C, mu, nu, up, 1e-6, 1e-5, n_iter=2)


@pytest.fixture(params=["registers", "chunks"])
def blocks(request, monkeypatch):
    """The shipped tiling, or tiny blocks: every slice streamed in chunks of 16 (the path of a column of 50,304;
    the interpreter runs a program's ops one by one and a streamed slice is a program of its own, so the chunked
    cases are kept small: two chunks, the last one partial, per slice)."""
    if request.param == "chunks":
        monkeypatch.setattr(dt, "BLOCK_N", 16)
        monkeypatch.setattr(dt, "ROW_TILE", 16)
        monkeypatch.setattr(dt, "STRIDED_ROWS", 4)
        monkeypatch.setattr(dt, "STRIDED_TILE", 16)
    return request.param


@pytest.mark.parametrize("v,u,noise,nonuni", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernels_equal_the_sort_reference(v, u, noise, nonuni, dtype):
    """P and dC of the Triton route equal autograd through the sort reference (float64 1e-12; float32 within its
    rounding), shapes off the block sizes, the paper's init (every entry tied) included."""
    C, mu, nu = problem(v, u, noise, seed=v + u, nonuniform=nonuni, dtype=dtype)
    up = torch.randn(v, u, dtype=dtype, generator=torch.Generator().manual_seed(1))
    tol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-6, 1e-5)
    P = assert_equals_reference(lambda c: dykstra(c, TritonSteps(mu, nu), 3), C, mu, nu, up, *tol)
    assert P.dtype == dtype and P.stride() == (1, v)  # column-major: a column per program


def test_streamed_in_chunks(blocks):
    """Rows of 20 and columns of 18 entries in chunks of 16 (and whole, for comparison): the sort reference's."""
    C, mu, nu = problem(18, 20, 1e-2, seed=7, nonuniform=True)
    up = torch.randn(18, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert dt._shape(20, 18)[2] is (blocks == "registers") and dt._shape(18, 20)[2] is (blocks == "registers")
    assert_equals_reference(lambda c: dykstra(c, TritonSteps(mu, nu), 2), C, mu, nu, up, n_iter=2)


def test_long_rows_are_read_several_a_program_and_columns_one():
    """Rows of u > 512 in the column-major plan (strided by v) are streamed STRIDED_ROWS a program, so a load reads
    consecutive entries along the strided dimension; columns (contiguous) stay one a program, forward and backward;
    the thresholds-only launch on row-major rows (contiguous) too. A row-major upstream gradient is read by the
    column backward from a column-major copy (contiguous along the columns)."""
    seen, g_strides = [], []

    class Rec:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append((kw.get("HAS_GC", kw.get("APPLY")), a[9] if "APPLY" in kw else a[5], kw["BS"], kw["BN"],
                             kw["ONE_CHUNK"]))
                if "HAS_GC" in kw and a[5] == u:
                    g_strides.append(a[7:9])
            return launch

    v, u = 5000, 700
    real = dt._get
    dt._get = lambda: (Rec(), Rec())
    try:
        mu, nu = torch.full((v,), 1.0 / v), torch.full((u,), 1.0 / u)
        C = torch.rand(v, u, requires_grad=True)
        dykstra(C, TritonSteps(mu, nu), 1).backward(torch.ones(v, u))
        TritonSteps(None, None).thresholds(torch.rand(8, u), mu[:8], 1)
    finally:
        dt._get = real
    rows = [s for s in seen if s[1] == v]
    cols = [s for s in seen if s[1] == u]
    assert len(rows) == 2 and all(s[2:] == (dt.STRIDED_ROWS, dt.STRIDED_TILE // dt.STRIDED_ROWS, False) for s in rows)
    assert len(cols) == 2 and all(s[2:] == (1, dt.BLOCK_N, False) for s in cols)
    assert seen[-1][1:] == (8, 1, dt.BLOCK_N, True)
    assert g_strides == [(v, 1)], g_strides  # (between columns, along a column)


def test_edge_cases():
    """Ties, all-equal blocks, one-hot and very negative rows and columns, zero marginals: exact (float64)."""
    C, mu, nu = edge_problem(v=40, u=36)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for n_iter in (1, 3):
        assert_equals_reference(lambda c: dykstra(c, TritonSteps(mu, nu), n_iter), C, mu, nu, up, n_iter=n_iter)


def test_search_only_thresholds_and_counts(blocks):
    """The search without the projection (the sharded rows'): the sort's thresholds and the supports' sizes."""
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(20, 18, generator=g, dtype=torch.float64)
    Z[:5] = 0.25  # all equal
    for dim in (0, 1):
        s = torch.rand(Z.shape[1 - dim], generator=g, dtype=torch.float64)
        s[1] = 0.0
        tau, cnt = TritonSteps(None, None).thresholds(Z, s, dim)
        ref = sort_thresholds(Z, s, dim)
        torch.testing.assert_close(tau, ref, rtol=0, atol=1e-13)
        assert torch.equal(cnt.long(), (Z > ref.unsqueeze(dim)).sum(dim))


def test_sparsemax_on_the_cuda_route(monkeypatch):
    """The public sparsemax with the CUDA route's steps (what steps_for gives on a GPU): the sort reference's values
    and gradients, slices along either dim, a zero scale among them (the kernels' chunked path: the tests above)."""
    import s2t2_dist.ot.simplex as simplex
    from s2t2_dist.ot import sparsemax
    from tests.helpers.sinkhorn_reference import sort_sparsemax

    taken = []
    monkeypatch.setattr(simplex, "steps_for", lambda device, mu, nu: taken.append(1) or TritonSteps(mu, nu))
    g = torch.Generator().manual_seed(2)
    Z = torch.randn(20, 18, generator=g, dtype=torch.float64)
    Z[:4] = 0.5  # ties
    up = torch.randn(Z.shape, generator=g, dtype=torch.float64)
    for dim in (0, 1):
        s = torch.rand(Z.shape[1 - dim], generator=g, dtype=torch.float64)
        s[5] = 0.0  # (not on a row of ties: there the sort's gradient is one subgradient of many)
        out = []
        for f in (lambda z: sparsemax(z, s, dim), lambda z: sort_sparsemax(z.movedim(dim, -1), s, 1).movedim(-1, dim)):
            z = Z.clone().requires_grad_(True)
            (f(z) * up).sum().backward()
            out.append((f(Z.detach()), z.grad))
        (p, gz), (pr, gzr) = out
        torch.testing.assert_close(p, pr, rtol=0, atol=1e-12)
        torch.testing.assert_close(gz, gzr, rtol=0, atol=1e-10)
    assert taken  # the Triton steps ran, not the torch ones


def test_no_host_syncs():
    C, mu, nu = problem(300, 40, 1e-3, seed=4, dtype=torch.float32)
    Cg = C.clone().requires_grad_(True)
    with count_host_syncs() as c:
        dykstra(Cg, TritonSteps(mu, nu), 3).backward(torch.ones_like(C))
    assert c.total == 0, c.summary()


def _counted(v, u, dry):
    C, mu, nu = problem(v, u, 1e-3, seed=5, dtype=torch.float32)
    Cg = C.clone().requires_grad_(True)
    before = dt.launches[0]
    with count_host_syncs() as c:
        if dry:
            with dry_run():
                dykstra(Cg, TritonSteps(mu, nu), 3).backward(torch.ones_like(C))
        else:
            dykstra(Cg, TritonSteps(mu, nu), 3).backward(torch.ones_like(C))
    return c.ops, dt.launches[0] - before, c.total


def test_kernel_count_at_olmo_size():
    """Forward + backward at 50,304 x 512, 3 iterations: 12 Triton launches and a few dozen aten ops (at most one
    kernel each), 0 host reads. Counted with the launches recorded, not run (dry_run: the route reads nothing
    back, so what it issues cannot depend on the kernels' results): the same counts at any size, and a real
    interpreted run launches as many kernels (its aten ops include the interpreter's own copies)."""
    ops, launches, syncs = _counted(50304, 512, dry=True)
    print(f"\nCUDA route, 50,304 x 512, fwd + bwd: {launches} Triton launches + {ops} aten ops = {launches + ops}")
    assert launches == 12 and syncs == 0
    assert ops + launches <= 100, ops
    assert _counted(90, 20, dry=True) == (ops, launches, 0)
    assert _counted(90, 20, dry=False)[1:] == (launches, 0)


def _sharded(v, u, noise, seed):
    rank, R = dist.get_rank(), dist.get_world_size()
    C, mu, nu = problem(v, u, noise, seed=seed, nonuniform=True)
    up = torch.randn(v, u, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a, b = shard_bounds(u, R, rank)
    comm = GroupComm()
    steps = ShardedSteps(TritonSteps(mu, nu[a:b]), comm, [e - s for s, e in (shard_bounds(u, R, r)
                                                                              for r in range(R))], mu)
    Cl = C[:, a:b].clone().requires_grad_(True)
    with count_host_syncs() as c:
        P = dykstra(Cl, steps, 3)
        (P * up[:, a:b]).sum().backward()
    return P.detach(), Cl.grad, c.total


def test_sharded_on_two_ranks_equals_one_process():
    """C's columns over 2 gloo ranks, each rank's columns by the kernels, rows by transposition: P and dC equal the
    single-process sort reference (float64), no host reads."""
    v, u = 150, 37
    res = run_distributed(_sharded, 2, v, u, 0.3, 3, timeout=300)
    C, mu, nu = problem(v, u, 0.3, seed=3, nonuniform=True)
    up = torch.randn(v, u, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    P = torch.cat([r[0] for r in res], 1)
    G = torch.cat([r[1] for r in res], 1)
    Cg = C.clone().requires_grad_(True)
    from tests.helpers.sinkhorn_reference import reference_sinkhorn

    Pr = reference_sinkhorn(Cg, mu, nu, 3)
    (Pr * up).sum().backward()
    assert float((P - Pr).detach().abs().max()) < 1e-12 and float((G - Cg.grad).abs().max()) < 1e-12
    assert [r[2] for r in res] == [0, 0]


def test_first_use_check_passes_where_the_kernels_run():
    """The route's one-off check (every launch: the streamed-column and registers-row kernels, forward + backward,
    and the thresholds alone, against the torch steps) passes where the kernels run."""
    from s2t2_dist.ot.routing import kernels_ok

    assert kernels_ok(torch.device("cpu"))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_first_use_check_passes_whatever_the_callers_mode(mode):
    """Stage 1's first plan is taken under no_grad: the check (which runs a backward) passes there too."""
    from s2t2_dist.ot.routing import kernels_ok

    kernels_ok.cache_clear()
    with getattr(torch, mode)():
        assert kernels_ok(torch.device("cpu"), (70, 9))
    kernels_ok.cache_clear()


def test_a_launch_the_check_covers_fails_it(monkeypatch, caplog):
    """The thresholds-only launch (the sharded rows') wrong: the check fails (one warning) and the route falls back
    to the torch steps, as for a failing projection; a tiling of its own is checked at that tiling."""
    import s2t2_dist.ot.routing as dy
    from s2t2_dist.utils import routes

    real = TritonSteps.thresholds
    monkeypatch.setattr(TritonSteps, "thresholds", lambda self, Z, s, dim: (real(self, Z, s, dim)[0] * 1.5,
                                                                          real(self, Z, s, dim)[1]))
    monkeypatch.setattr(dy, "kernel_device", lambda device: True)
    dy.kernels_ok.cache_clear()
    mu, nu = torch.full((40,), 1 / 40), torch.full((6,), 1 / 6)
    with caplog.at_level("WARNING"):
        assert not dy.kernels_ok(torch.device("cpu"), (40, 6))
        assert isinstance(dy.steps_for(torch.device("cpu"), mu, nu, ((40, 6),), on_route=routes.record), dy.TorchSteps)
    assert sum("failed their first-use check at 40 x 6" in r.message for r in caplog.records) == 1
    r = routes.summary()["sinkhorn"]
    assert r["route"] == "torch steps" and r["fallback"] and "differs from the torch steps'" in r["why"], r
    assert "float32: the thresholds of a " in r["why"], r  # the part that failed, named
    monkeypatch.setattr(TritonSteps, "thresholds", real)
    dy.kernels_ok.cache_clear()
    assert isinstance(dy.steps_for(torch.device("cpu"), mu, nu, ((40, 6),), on_route=routes.record), TritonSteps)
    assert routes.summary()["sinkhorn"]["route"] == "kernels"
    dy.kernels_ok.cache_clear()


def test_kernel_diag_every_launch_agrees_in_every_variant(monkeypatch):
    """bench/kernel_diag.py (what a GPU run uses to find a launch that fails the first-use check): on a plan whose
    columns stream in two chunks, every launch agrees with the torch steps, specialised by Triton or not."""
    import bench.kernel_diag as kd
    variants = kd.variants()
    assert {"specialised", "none"} <= set(variants)
    for name, kernels in variants.items():
        monkeypatch.setattr(dt, "_get", lambda k=kernels: k)
        r = kd.diagnose(torch.device("cpu"), dt.BLOCK_N + 52, 5)
        parts = {k: x for k, x in r.items() if "n_off" in x}
        assert len(parts) == 28 and not [k for k, x in parts.items() if x["n_off"]], (name, r)
        assert r["first-use check"]["verdict"] == "passes", (name, r["first-use check"])


def test_kernel_diag_names_the_launch_and_the_chunk_that_is_off(monkeypatch):
    """A column projection wrong in its second chunk only: the diagnosis names that launch and that chunk, and
    every other launch agrees."""
    import bench.kernel_diag as kd
    real = TritonSteps.col

    def col(self, Qc, X):
        out = real(self, Qc, X)
        X[dt.BLOCK_N + 3, 1] += 1.0
        return out

    monkeypatch.setattr(TritonSteps, "col", col)
    r = kd.diagnose(torch.device("cpu"), dt.BLOCK_N + 52, 5)
    off = {k: x for k, x in r.items() if x.get("n_off")}
    assert set(off) == {"column projection: projection", "column projection, second: projection"}, off
    assert off["column projection: projection"]["chunks_off"] == [1]
    assert off["column projection: projection"]["slices_off"] == [1]
    assert off["column projection: projection"]["first_off"] == [dt.BLOCK_N + 3, 1]
