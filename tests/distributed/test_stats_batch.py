"""StatsBatch (s2t2_dist/distributed/stats_batch.py): every value a logging step reduces, in one all_reduce and one read;
and the translator's statistics through it equal, to the last bit, what the one-collective-per-statistic code
before it computed (a reference kept here), on 1, 2 and 3 gloo ranks with C's columns sharded."""
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from s2t2_dist.distributed.stats_batch import StatsBatch
from s2t2_dist.ot.entropy import entropy
from s2t2_dist.translator import PStats, TokenTranslator


@contextmanager
def _count_collectives():
    """Counts dist.all_reduce / all_gather calls while active."""
    calls = {"n": 0}
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def wrap(fn):
        def wrapped(*a, **kw):
            calls["n"] += 1
            return fn(*a, **kw)
        return wrapped
    for name, fn in real.items():
        setattr(dist, name, wrap(fn))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _batch_worker():
    r, w = dist.get_rank(), dist.get_world_size()
    b = StatsBatch("cpu")
    b.add("s", torch.tensor([r + 1.0, 2.0**51 + r], dtype=torch.float64))  # exact: float64 holds the integers
    b.add("i", torch.tensor(r + 3, dtype=torch.int64))
    b.add("f32", torch.tensor(0.1 * (r + 1), dtype=torch.float32))
    b.add("mx", torch.tensor([float(r), -float(r)]), "max")
    b.add("mn", torch.tensor([float(r), -float(r)]), "min")
    b.add("host", 0.5)
    b.add("own", torch.tensor([[r, 2 * r]], dtype=torch.int32), "local")
    b.add("flag", torch.tensor(r == 0), "max")
    # rows: uneven shards of a 5 x 2 tensor (rank r holds rows [start, end)); an empty shard is allowed
    bounds = [(0, 3), (3, 5)] if w == 2 else [(0, 2), (2, 4), (4, 5)] if w == 3 else [(0, 5)]
    a, e = bounds[r]
    full = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    b.add_rows("rows", full[a:e], a, 5)
    b.add_rows("none", torch.zeros(0, 2), 5, 5)
    with _count_collectives() as calls:
        red = b.reduce()
    n = calls["n"]
    with pytest.raises(RuntimeError, match="already reduced"):
        b.reduce()
    return {k: red[k] for k in ("s", "i", "f32", "mx", "mn", "host", "own", "flag", "rows", "none")}, n


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_all_reduce_every_op(world):
    res = run_distributed(_batch_worker, world, timeout=120)
    for r, (out, n) in enumerate(res):
        assert n == (1 if world > 1 else 0)  # one collective, whatever was registered
        assert out["s"].tolist() == [sum(q + 1.0 for q in range(world)), world * 2.0**51 + sum(range(world))]
        assert out["i"].dtype == np.int64 and int(out["i"]) == sum(q + 3 for q in range(world))
        f32 = np.float32(sum(np.float64(np.float32(0.1 * (q + 1))) for q in range(world)))  # one rounding
        assert out["f32"].dtype == np.float32 and out["f32"] == f32
        assert out["mx"].tolist() == [world - 1, 0] and out["mn"].tolist() == [0, -(world - 1)]
        assert float(out["host"]) == 0.5 * world
        assert out["own"].dtype == np.int32 and out["own"].tolist() == [[r, 2 * r]]  # not reduced
        assert out["flag"].dtype == np.bool_ and bool(out["flag"])
        assert out["rows"].dtype == np.float32 and out["rows"].tolist() == np.arange(10).reshape(5, 2).tolist()
        assert out["none"].shape == (5, 2) and not out["none"].any()


def test_misuse():
    b = StatsBatch()
    b.add("a", 1.0)
    with pytest.raises(ValueError, match="twice"):
        b.add("a", 2.0)
    with pytest.raises(ValueError, match="op must be"):
        b.add("b", 1.0, "mean")
    with pytest.raises(ValueError, match="add_rows"):
        b.add("c", 1.0, "rows")
    with pytest.raises(ValueError, match="do not fit"):
        b.add_rows("d", torch.zeros(3), 2, 4)
    with pytest.raises(TypeError, match="dtype"):
        b.add("e", torch.zeros(2, dtype=torch.complex64))
    assert float(b.reduce()["a"]) == 1.0
    assert "x" not in StatsBatch().reduce()  # an empty batch: nothing to reduce


def _nccl_like_worker():
    """A default group without a CPU backend (like NCCL alone): a CPU batch goes to the gloo host group."""
    b = StatsBatch("cpu")
    b.add("x", float(dist.get_rank() + 1))
    return float(b.reduce()["x"])


def test_cpu_batch_on_a_group_without_cpu_backend():
    assert run_distributed(_nccl_like_worker, 2, backend="cuda:gloo", timeout=120) == [3.0, 3.0]


# ------------------------------------------------------------------------------------------------ the translator
V, U = 30, 11  # 11 columns: uneven shards on 2 and 3 ranks


def _translator(group, dtype, kind):
    g = torch.Generator().manual_seed(3)
    src = torch.randint(1, 40, (V,), generator=g).double()
    tgt = torch.randint(1, 40, (U,), generator=g).double()
    tgt[4] = 0  # a target token of zero mass: left out of the mass statistics
    tr = TokenTranslator.from_frequencies(src, tgt, kind=kind, group=group, dtype=dtype)
    with torch.no_grad():
        C = torch.full((V, U), 1.0 / V, dtype=torch.float64) + 2e-2 * torch.randn(V, U, generator=g,
                                                                                 dtype=torch.float64)
        tr.C.copy_(C[:, tr.col_start: tr.col_end])
    st = PStats(tr)
    st.watch_grad()
    E = torch.randn(V, 5, generator=g, dtype=dtype)
    tr.embed_and_head(E)[1].square().sum().backward()
    st.end_step()
    return st


def _old_report(st, heat):
    """The statistics as computed before the fused reduction (one collective per statistic, torch on every
    value): the reference the fused ones must equal exactly."""
    tr = st.tr
    P = tr.P()
    c = tr.comm() if tr.sharded else None
    nz = P != 0
    rows, cols = nz.sum(1), nz.sum(0)
    if c:
        rows, cols = c.all_reduce(rows, "sum"), c.all_gather_rows(cols, tr.col_sizes)
    nnz = int(rows.sum())
    out = {"nnz": nnz, "density": nnz / float(rows.numel() * cols.numel()),
           "row_nnz_mean": float(rows.double().mean()), "row_nnz_max": float(rows.max()),
           "rows_empty": float((rows == 0).sum()), "col_nnz_mean": float(cols.double().mean()),
           "col_nnz_min": float(cols.min()), "col_nnz_max": float(cols.max())}
    out = {k: float(v) for k, v in out.items()}
    rs = P.double().sum(1)
    col_err = (P.double().sum(0) - tr.nu_local.double()).abs().max().reshape(1)
    if c:
        rs, col_err = c.all_reduce(rs, "sum"), c.all_reduce(col_err, "max")
    out.update(row_err=float((rs - tr.mu.double()).abs().max()), col_err=float(col_err))
    out["entropy"] = float(tr._entropy_global())
    W = tr.weights(P, "head")[:, tr.nu_local > 0]
    Wp = W.clamp_min(0)
    t = torch.stack([W.max(0).values.double().sum(), -torch.special.xlogy(Wp, Wp).sum(0).double().sum(),
                     torch.tensor(float(W.shape[1]), dtype=torch.float64)])
    if c:
        t = c.all_reduce(t, "sum")
    n = max(float(t[2]), 1.0)
    out.update(max_weight_mean=float(t[0]) / n, col_entropy_mean=float(t[1]) / n)
    live, run = st._grad_live.reshape(1), st._grad_zero_run.reshape(1)
    if c:
        live, run = c.all_reduce(live, "sum"), c.all_reduce(run, "min")
    out.update(grad_live_frac=float(live) / float(tr.v * tr.u), grad_frozen_steps=float(run))
    vals, idx = tr.weights(P, "head").t().topk(3, dim=1)
    a, b = tr.col_start, min(tr.col_end, heat[1])
    block = P[: heat[0], : max(b - a, 0)]
    if c:
        vals, idx = c.all_gather_rows(vals.contiguous(), tr.col_sizes), c.all_gather_rows(idx.contiguous(),
                                                                                          tr.col_sizes)
        sizes = [max(min(e, heat[1]) - s, 0) for s, e in zip(np.cumsum([0] + tr.col_sizes[:-1]).tolist(),
                                                              np.cumsum(tr.col_sizes).tolist())]
        block = c.all_gather_rows(block.t().contiguous(), sizes).t()
    top = {j: [(int(i), float(w)) for i, w in zip(idx[j].tolist(), vals[j].tolist()) if w > 0]
           for j in range(vals.shape[0])}
    return out, top, block.contiguous()


def _new_report(st, heat):
    """The fused statistics: every one registered into one batch, one all_reduce."""
    P = st.tr.P()
    with _count_collectives() as calls:
        b = st.stats_batch()
        parts = [st.add_density(b, P), st.add_marginals(b, P), st.add_mass(b, P), st.add_grad(b)]
        ent, top, block = st.add_entropy(b, P), st.add_top(b, 3, P), st.add_block(b, *heat, P)
        r = b.reduce()
    out = {k: v for part in parts for k, v in part(r).items()}
    out["entropy"] = ent(r)
    return out, top(r), block(r), calls["n"]


def _compare_worker(dtype, kind, heat):
    group = dist.group.WORLD if dist.is_initialized() else None
    tr = _translator(group, dtype, kind)
    with torch.no_grad():
        new = _new_report(tr, heat)
        old = _old_report(tr, heat)
    return old, new


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "sparse"), (torch.float64, "sparse"),
                                        (torch.float32, "softmax"), (torch.float32, "unconstrained")])
def test_fused_statistics_equal_the_per_statistic_ones(world, dtype, kind):
    heat = (7, 9)
    res = ([_compare_worker(dtype, kind, heat)] if world == 1 else
           run_distributed(_compare_worker, world, dtype, kind, heat, timeout=120))
    for (old, top_old, block_old), (new, top_new, block_new, n) in res:
        assert n == (1 if world > 1 else 0)
        if world <= 2:  # every value to the last bit, float32 entropy included
            assert new == old
        else:  # a ring all-reduce over 3 ranks adds each element in an order set by its place in the buffer
            assert new == pytest.approx(old, rel=1e-14, abs=0)
        assert top_new == top_old
        assert block_new.dtype == block_old.dtype and torch.equal(block_new, block_old)
        assert math.isfinite(new["entropy"]) and new["grad_live_frac"] > 0


def test_entropy_of_the_batch_is_h():
    st = _translator(None, torch.float64, "sparse")
    b = st.stats_batch()
    h = st.add_entropy(b)
    assert h(b.reduce()) == float(entropy(st.tr.P().detach()))
