"""TokenTranslator: shapes, normalisations, tying, kinds, statistics, export; 1-3 gloo ranks equal one process."""
import math

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from s2t2_dist.ot.entropy import entropy
from s2t2_dist.translator import PStats, TokenTranslator

V, VOCAB, D = 40, 52, 6  # source tokens, rows of the source model's (padded) E, width


def _frozen(seed=0):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    L = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    src_ids = torch.randperm(VOCAB, generator=g)[:V]
    return E, L, src_ids


def _moved_C(v, u, noise, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.full((v, u), 1.0 / v, dtype=torch.float64) + noise * torch.randn(v, u, generator=g,
                                                                                  dtype=torch.float64)


def _make(u, kind="sparse", normalization="convex", group=None, noise=2e-2, freqs=False):
    kw = dict(kind=kind, normalization=normalization, group=group, dtype=torch.float64)
    if freqs:
        g = torch.Generator().manual_seed(5)
        tr = TokenTranslator.from_frequencies(torch.randint(1, 50, (V,), generator=g).double(),
                                              torch.randint(1, 50, (u,), generator=g).double(), **kw)
    else:
        tr = TokenTranslator(V, u, **kw)
    with torch.no_grad():
        tr.C.copy_(_moved_C(V, u, noise)[:, tr.col_start: tr.col_end])
    return tr


def test_shapes_tying_and_init():
    E, L, ids = _frozen()
    tr = TokenTranslator(V, 9, dtype=torch.float64)
    assert tr.C.shape == (V, 9) and torch.all(tr.C == 1.0 / V)
    Ep, Lp = tr.embed_and_head(E, L, ids)
    assert Ep.shape == (9, D) and Lp.shape == (9, D)
    # at the paper's init every target token is the mean of the source rows (uniform marginals)
    assert torch.allclose(Ep, E[ids].mean(0).expand(9, D), atol=1e-12)
    assert torch.allclose(Lp, L[ids].mean(0).expand(9, D), atol=1e-12)
    # tied: one tensor for both
    Et, Lt = tr.embed_and_head(E, E, ids)
    assert Et is Lt
    Et2, Lt2 = tr.embed_and_head(E, None, ids)
    assert Et2 is Lt2 and torch.equal(Et2, Et)
    # src_ids select rows; padding rows of E never get mass
    E_pad = E.clone()
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[ids] = False
    E_pad[others] = 1e6
    assert torch.allclose(tr.embed_and_head(E_pad, None, ids)[0], Et)
    with pytest.raises(ValueError, match="src_ids"):
        tr.embed_and_head(E, L, ids[:-1])
    with pytest.raises(ValueError, match="rows"):
        tr.embed_and_head(E, L)


def test_registered_run_of_source_ids_reads_a_view_with_the_same_results():
    """Registered ids that are one ascending run give the source rows as a view of E and L (no per-step copy) and
    the same E', L' and gradient on C as the gather; any other ids (registered or not) are gathered."""
    E, L, _ = _frozen()
    run, perm = torch.arange(5, 5 + V), torch.randperm(V, generator=torch.Generator().manual_seed(2)) + 3
    for ids in (run, perm):
        ref, tr = _make(9), _make(9)
        tr.register_source_ids(ids)
        rows = tr._source_rows(E, ids)
        assert (rows.untyped_storage().data_ptr() == E.untyped_storage().data_ptr()) == (ids is run)
        assert torch.equal(rows, E[ids])
        for t in (ref, tr):
            Ep, Lp = t.embed_and_head(E, L, ids)
            (Ep.sum() + (Lp ** 2).sum()).backward()
        assert torch.equal(tr.embed_and_head(E, L, ids)[0], ref.embed_and_head(E, L, ids)[0])
        torch.testing.assert_close(tr.C.grad, ref.C.grad, rtol=0, atol=1e-15)
    tr = _make(9)
    tr.register_source_ids(run)
    assert tr._source_rows(E, run.clone()).untyped_storage().data_ptr() != E.untyped_storage().data_ptr()


def test_normalisations_which_weights_sum_to_one():
    tr_c = _make(9, normalization="convex", freqs=True)
    tr_p = _make(9, normalization="paper", freqs=True)
    Wc = tr_c.weights()
    assert torch.allclose(Wc.sum(0), torch.ones(9, dtype=torch.float64), atol=1e-12)  # convex: every column
    assert (Wc >= 0).all()
    WeP, WlP = tr_p.weights(part="embed"), tr_p.weights(part="head")
    assert torch.allclose(WlP.sum(0), torch.ones(9, dtype=torch.float64), atol=1e-12)  # paper L' = (P/nu)^T L
    dev = (WeP.sum(0) - 1).abs().max()
    print(f"\npaper E' weights P_ij/mu_i: column sums {WeP.sum(0).min():.3f}..{WeP.sum(0).max():.3f} (not 1)")
    assert dev > 0.1  # the literal E' = (P^T (1/mu)) E is not a convex combination
    P = tr_p.P()
    assert torch.allclose(WeP, P / tr_p.mu[:, None]) and torch.allclose(WlP, P / tr_p.nu[None, :])
    E, L, ids = _frozen()
    Ep, Lp = tr_p.embed_and_head(E, L, ids)
    assert torch.allclose(Ep, WeP.t() @ E[ids]) and torch.allclose(Lp, WlP.t() @ L[ids])
    # tied E = L with the paper normalisation: two different tensors
    Et, Lt = tr_p.embed_and_head(E, E, ids)
    assert Et is not Lt and not torch.allclose(Et, Lt)


def test_kinds_and_unconstrained_weights():
    E, L, ids = _frozen()
    for kind in ("sparse", "softmax", "unconstrained"):
        tr = _make(7, kind=kind)
        P = tr.P()
        assert P.shape == (V, 7)
        Ep, Lp = tr.embed_and_head(E, L, ids)
        (Ep.square().sum() + Lp.sum() + tr.entropy_local()).backward()
        assert torch.isfinite(tr.C.grad).all() and tr.C.grad.abs().sum() > 0
        if kind == "softmax":
            assert (P > 0).all()
        if kind == "sparse":
            assert (P == 0).any()
        if kind == "unconstrained":
            assert torch.allclose(tr.weights(), tr.C.detach())
    with pytest.raises(ValueError, match="kind"):
        TokenTranslator(V, 7, kind="dense")
    with pytest.raises(ValueError, match="normalization"):
        TokenTranslator(V, 7, normalization="mean")
    with pytest.raises(ValueError, match="nu must sum to 1"):
        TokenTranslator(V, 3, nu=torch.tensor([0.5, 0.5, 0.5]))


def test_zero_frequency_target_and_entropy_gradient():
    tr = TokenTranslator.from_frequencies(torch.ones(V), torch.tensor([3.0, 0.0, 1.0, 2.0]), dtype=torch.float64)
    with torch.no_grad():
        tr.C.copy_(_moved_C(V, 4, 2e-2))
    P = tr.P()
    assert torch.equal(P[:, 1], torch.zeros(V, dtype=torch.float64))
    E, L, ids = _frozen()
    Ep, Lp = tr.embed_and_head(E, L, ids)
    assert torch.isfinite(Ep).all() and torch.equal(Ep[1], torch.zeros(D, dtype=torch.float64))
    H = tr.entropy_local()
    assert (P == 0).any()
    H.backward()
    assert torch.isfinite(tr.C.grad).all()
    assert torch.allclose(H.detach(), entropy(P.detach()))


def test_stats_export_cache():
    tr = _make(11, freqs=True)
    P = tr.P()
    assert tr.P() is P  # same step: the cached differentiable plan
    rows, cols = PStats(tr).nnz_per_row_and_col()
    assert torch.equal(rows, (P != 0).sum(1)) and torch.equal(cols, (P != 0).sum(0))
    st = PStats(tr).density_stats()
    assert st["nnz"] == float((P != 0).sum()) and st["col_nnz_max"] == float(cols.max())
    me = PStats(tr).marginal_errors()
    assert me["col_err"] < 1e-12 and me["row_err"] == pytest.approx(float((P.sum(1) - tr.mu).abs().max()))
    ex = tr.export_sparse()
    dense = torch.zeros(V, 11, dtype=torch.float64)
    dense[ex["indices"][0], ex["indices"][1] + ex["col_offset"]] = ex["values"]
    assert torch.equal(dense, P.detach()) and ex["shape"] == (V, 11)
    idx, vals = tr.gather_sparse()
    dense2 = torch.zeros(V, 11, dtype=torch.float64)
    dense2[idx[0], idx[1]] = vals
    assert torch.equal(dense2, P.detach())
    assert torch.equal(PStats(tr).gather_block(5, 4), P.detach()[:5, :4])
    top = PStats(tr).top_translations(k=2)
    W = tr.weights().detach()
    assert set(top) == set(range(11)) and top[3][0][0] == int(W[:, 3].argmax())
    # backward releases the step's P (no copy of P is kept between steps); the module stays copyable/savable
    P.sum().backward()
    assert tr._cache_grad is None and tr._cache_val is None
    import copy
    import io

    torch.save(copy.deepcopy(tr), io.BytesIO())
    # an optimiser step changes C: the plan is recomputed
    opt = torch.optim.SGD(tr.parameters(), lr=1e-3)
    opt.step()
    assert tr.P() is not P
    # init_from_dense: a feasible P is reproduced by the sparse kind
    tr2 = TokenTranslator(V, 11, mu=tr.mu, nu=tr.nu, dtype=torch.float64)
    with torch.no_grad():
        Pf = _full_feasible(tr.mu, tr.nu)
    tr2.init_from_dense(Pf)
    assert torch.allclose(tr2.P(), Pf, atol=1e-12)


def _full_feasible(mu, nu):
    return mu[:, None] * nu[None, :]


# ------------------------------------------------------------------------------------------------ distributed
CONFIGS = [  # (u, kind, normalization, tied, freqs)
    (12, "sparse", "convex", False, False),
    (13, "sparse", "convex", True, True),
    (13, "sparse", "paper", False, True),
    (13, "softmax", "convex", False, True),
    (12, "unconstrained", "paper", False, False),
]
ALPHA = 0.3


def _loss(Ep, Lp, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(Ep.shape, generator=g, dtype=Ep.dtype)
    B = torch.randn(Lp.shape, generator=g, dtype=Lp.dtype)
    return (Ep * A).sum() + (Lp.square() * B).sum()


def _run_configs(group=None, rank=0, world=1):
    E, L, ids = _frozen()
    out = []
    for u, kind, norm, tied, freqs in CONFIGS:
        tr = _make(u, kind, norm, group=group, freqs=freqs)
        st = PStats(tr)
        st.watch_grad()
        Lm = E if tied else L
        # (a) every rank computes the same loss, with the global entropy
        Ep, Lp = tr.embed_and_head(E, Lm, ids)
        loss = _loss(Ep, Lp, 0) + ALPHA * tr.entropy()
        loss.backward()
        g_same = tr.C.grad.clone()
        tr.C.grad = None
        # (b) data parallel: rank r has its own loss; the regulariser as the local share (the lead's recipe)
        Ep, Lp = tr.embed_and_head(E, Lm, ids)
        loss_r = _loss(Ep, Lp, 100 + rank) + ALPHA * tr.entropy_local()
        loss_r.backward()
        g_dp = tr.C.grad.clone()
        st.end_step()
        with torch.no_grad():
            res = dict(P=tr.P().clone(), Ep=Ep.detach().clone(), Lp=Lp.detach().clone(), loss=loss.detach(),
                       g_same=g_same, g_dp=g_dp, H=tr.entropy(), stats=PStats(tr).density_stats(),
                       marg=PStats(tr).marginal_errors(), sparse=tr.gather_sparse(), block=PStats(tr).gather_block(7, 9),
                       top=PStats(tr).top_translations(k=3), cols=(tr.col_start, tr.col_end), tied=Ep is Lp,
                       mass=PStats(tr).mass_stats(), grad=st.grad_stats(), g_live=int((g_dp != 0).sum()))
        out.append(res)
    return out


def _dist_worker():
    return _run_configs(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def _single_dp_grad(cfg, world):
    """Single-process gradient of mean_r loss_r + alpha * H (what the data-parallel case must give)."""
    u, kind, norm, tied, freqs = cfg
    E, L, ids = _frozen()
    tr = _make(u, kind, norm, freqs=freqs)
    Ep, Lp = tr.embed_and_head(E, E if tied else L, ids)
    loss = sum(_loss(Ep, Lp, 100 + r) for r in range(world)) / world + ALPHA * tr.entropy()
    loss.backward()
    return tr.C.grad


@pytest.fixture(scope="module")
def single():
    return _run_configs()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_translator_equals_single_process(world, single):
    results = run_distributed(_dist_worker, world, timeout=120)
    for c, cfg in enumerate(CONFIGS):
        ref = single[c]
        per = [results[r][c] for r in range(world)]
        u = cfg[0]
        assert [p["cols"] for p in per][0][0] == 0 and per[-1]["cols"][1] == u
        P = torch.cat([p["P"] for p in per], 1)
        assert torch.allclose(P, ref["P"], atol=1e-13, rtol=0), (cfg, (P - ref["P"]).abs().max())
        for p in per:
            assert torch.allclose(p["Ep"], ref["Ep"], atol=1e-12) and torch.allclose(p["Lp"], ref["Lp"], atol=1e-12)
            assert torch.allclose(p["loss"], ref["loss"], atol=1e-10)
            assert torch.allclose(p["H"], ref["H"], atol=1e-12)
            assert p["tied"] == ref["tied"]
            assert p["stats"] == pytest.approx(ref["stats"]) and p["marg"] == pytest.approx(ref["marg"], abs=1e-14)
            assert torch.equal(p["sparse"][0], ref["sparse"][0])
            assert torch.allclose(p["sparse"][1], ref["sparse"][1], atol=1e-13)
            assert torch.allclose(p["block"], ref["block"], atol=1e-13)
            assert p["mass"] == pytest.approx(ref["mass"], rel=1e-12)
            assert p["grad"]["grad_frozen_steps"] == 0 and p["grad"]["grad_live_frac"] == sum(
                q["g_live"] for q in per) / (V * u)  # global: every rank's local count summed
            assert p["top"].keys() == ref["top"].keys()
            assert all([i for i, _ in p["top"][j]] == [i for i, _ in ref["top"][j]] for j in ref["top"])
        G = torch.cat([p["g_same"] for p in per], 1)
        assert torch.allclose(G, ref["g_same"], atol=1e-11, rtol=0), (cfg, (G - ref["g_same"]).abs().max())
        G_dp = torch.cat([p["g_dp"] for p in per], 1)
        expect = _single_dp_grad(cfg, world)
        assert torch.allclose(G_dp, expect, atol=1e-11, rtol=0), (cfg, (G_dp - expect).abs().max())


def test_mass_stats_and_gradient_monitor():
    tr = TokenTranslator(4, 3, dtype=torch.float64)
    m = PStats(tr).mass_stats()  # the uniform start: every column spread over the 4 sources
    assert m["max_weight_mean"] == pytest.approx(0.25) and m["col_entropy_mean"] == pytest.approx(math.log(4))
    P = torch.zeros(4, 3, dtype=torch.float64)
    P[0, 0], P[1, 1], P[2, 2], P[3, 2] = 1 / 3, 1 / 3, 0.99 / 3, 0.01 / 3  # one-hot, one-hot, 99% on one entry
    m = PStats(tr).mass_stats(P)
    assert m["max_weight_mean"] == pytest.approx((1 + 1 + 0.99) / 3)
    assert m["col_entropy_mean"] == pytest.approx(-(0.99 * math.log(0.99) + 0.01 * math.log(0.01)) / 3)
    assert PStats(tr).density_stats(P)["density"] == pytest.approx(4 / 12)  # counts the 1% entry like any other
    st = PStats(tr)
    st.watch_grad()
    with pytest.raises(RuntimeError, match="watch_grad"):
        PStats(TokenTranslator(4, 3)).grad_stats()
    for step in range(3):  # a loss that does not depend on C: exactly zero gradient, counted per step
        (tr.C * 0).sum().backward()
        st.end_step()
        assert st.grad_stats() == {"grad_live_frac": 0.0, "grad_frozen_steps": step + 1}
        tr.C.grad = None
    # off the uniform start (there the gradient is zero up to round-off, so the test would hang on round-off)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tr.C.add_(torch.rand(4, 3, generator=g, dtype=torch.float64) * 0.2)
    E = torch.randn(4, 2, generator=g, dtype=torch.float64)
    tr.embed_and_head(E)[1].square().sum().backward()
    st.end_step()
    g = st.grad_stats()
    assert g["grad_frozen_steps"] == 0 and g["grad_live_frac"] == float((tr.C.grad != 0).double().mean()) > 0


def _accumulated_grad(cfg, step_mode, group=None, rank=0, world=1, micro=3):
    """C's gradient (and the number of plans computed) after one optimiser step of ``micro`` micro-batches of
    ``mean_m loss_m + ALPHA * H``, as the loop runs them (each micro-batch loss / micro); with ``step_mode`` the
    plan and E', L', H are computed once (begin_step/finish_step), else once per micro-batch."""
    u, kind, norm, tied, freqs = cfg
    E, L, ids = _frozen()
    Lm = E if tied else L
    tr = _make(u, kind, norm, group=group, freqs=freqs)
    plans = []
    inner = tr.plan_kind.plan
    tr.plan_kind.plan = lambda C: plans.append(1) or inner(C)
    if step_mode:
        tr.begin_step(E, Lm, ids, entropy=True)
    for m in range(micro):
        Ep, Lp = tr.embed_and_head(E, Lm, ids)
        ((_loss(Ep, Lp, 100 * m + rank) + ALPHA * tr.entropy()) / micro).backward()
    if step_mode:
        tr.finish_step()
    return tr.C.grad.clone(), len(plans)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c[1]}-{c[2]}-{'tied' if c[4] else 'untied'}" for c in CONFIGS])
def test_one_plan_per_step_equals_per_micro_batch(cfg):
    """Gradient accumulation over 3 micro-batches: E', L' and H built once per step and one backward into C give
    (float64) the gradient of the per-micro-batch recomputation, with one Sinkhorn instead of three."""
    g_ref, n_ref = _accumulated_grad(cfg, step_mode=False)
    g, n = _accumulated_grad(cfg, step_mode=True)
    assert n_ref == 3 and n == 1
    assert g.abs().max() > 0
    assert torch.allclose(g, g_ref, atol=1e-13, rtol=1e-11), (g - g_ref).abs().max()


def _dist_step_grads():
    return [_accumulated_grad(cfg, True, dist.group.WORLD, dist.get_rank(), dist.get_world_size())[0]
            for cfg in CONFIGS]


def _single_dp_step_grad(cfg, world, micro=3):
    """Single process, per micro-batch: the gradient of mean_m (mean_r loss_{m,r} + ALPHA * H)."""
    u, kind, norm, tied, freqs = cfg
    E, L, ids = _frozen()
    tr = _make(u, kind, norm, freqs=freqs)
    for m in range(micro):
        Ep, Lp = tr.embed_and_head(E, E if tied else L, ids)
        loss = sum(_loss(Ep, Lp, 100 * m + r) for r in range(world)) / world + ALPHA * tr.entropy()
        (loss / micro).backward()
    return tr.C.grad


def test_one_plan_per_step_sharded_equals_single_process():
    """Two ranks, C's columns sharded, each rank its own micro-batches, one plan per step: the gradient is the
    single process's data-parallel gradient computed per micro-batch."""
    results = run_distributed(_dist_step_grads, 2, timeout=120)
    for c, cfg in enumerate(CONFIGS):
        G = torch.cat([results[r][c] for r in range(2)], 1)
        ref = _single_dp_step_grad(cfg, 2)
        assert torch.allclose(G, ref, atol=1e-11, rtol=0), (cfg, (G - ref).abs().max())
