"""Scaled sparsemax against an independent sort-based numpy reference; closed-form backward; building blocks."""
import numpy as np
import pytest
import torch

from s2t2_dist.ot.simplex import SimplexProjector, sparsemax, threshold_from_sorted_candidates
from s2t2_dist.utils.syncs import count_host_syncs


def ref_sparsemax(z, scale=1.0, axis=-1):
    """Algorithm 2 of the paper (sort, k(z) = max{k: scale + k z_(k) > sum_{j<=k} z_(j)}, tau) in float64 numpy."""
    z = np.asarray(z, dtype=np.float64)
    kshape = list(z.shape)
    kshape[axis] = 1
    sc = np.moveaxis(np.broadcast_to(np.asarray(scale, dtype=np.float64), kshape), axis, -1).reshape(-1)
    z = np.moveaxis(z, axis, -1)
    flat = z.reshape(-1, z.shape[-1])
    zs = -np.sort(-flat, axis=1)
    cs = np.cumsum(zs, axis=1)
    j = np.arange(1, flat.shape[1] + 1)
    cond = sc[:, None] + j * zs > cs
    k = np.where(cond.any(1), flat.shape[1] - np.argmax(cond[:, ::-1], axis=1), 1)  # largest such k
    tau = (cs[np.arange(len(k)), k - 1] - sc) / k
    out = np.maximum(flat - tau[:, None], 0)
    return np.moveaxis(out.reshape(z.shape), -1, axis)


SHAPES = [((1,), 0), ((7,), 0), ((5, 9), 1), ((5, 9), 0), ((3, 4, 6), 1), ((3, 4, 6), 2), ((2, 1, 3), 1),
          ((40, 300), 1), ((300, 40), 0), ((2, 3, 130), -1), ((9, 1), 1)]


@pytest.mark.parametrize("shape,dim", SHAPES)
@pytest.mark.parametrize("scale", [0.0, 1e-4, 1.0, 37.5])
def test_matches_reference_float64(shape, dim, scale):
    g = torch.Generator().manual_seed(hash((shape, dim, scale)) % 2**31)
    z = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    p = sparsemax(z, scale, dim)
    r = ref_sparsemax(z.numpy(), scale, dim)
    np.testing.assert_allclose(p.numpy(), r, atol=1e-12 * (1 + scale), rtol=0)
    assert (p >= 0).all()
    np.testing.assert_allclose(p.sum(dim).numpy(), np.full(p.sum(dim).shape, scale), atol=1e-12 * (1 + scale))


@pytest.mark.parametrize("shape,dim", [((6, 50), 1), ((50, 6), 0), ((3, 700, 2), 1)])
def test_per_slice_scale_and_float32(shape, dim):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(shape, generator=g)
    kshape = list(shape)
    kshape[dim] = 1
    s = torch.rand(kshape, generator=g) * 2
    s.view(-1)[0] = 0.0  # one slice with scale 0
    p = sparsemax(z, s, dim)
    assert p.dtype == torch.float32
    r = ref_sparsemax(z.double().numpy(), s.double().numpy(), dim)
    np.testing.assert_allclose(p.numpy(), r, atol=1e-5)
    np.testing.assert_allclose(p.sum(dim, keepdim=True).numpy(), s.numpy(), atol=1e-5)
    # the "shape without dim" form of the scale gives the same result
    p2 = sparsemax(z, s.squeeze(dim), dim)
    assert torch.equal(p, p2)
    # scale 0: exactly zero
    assert float(p.movedim(dim, -1).reshape(-1, shape[dim])[0].abs().sum()) == 0.0


def test_ties_large_magnitudes_single_elements():
    # all ties (the paper's init): full support, every entry scale/n
    z = torch.full((4, 1000), 1 / 50304, dtype=torch.float64)
    p = sparsemax(z, 0.5, 1)
    assert torch.allclose(p, torch.full_like(p, 0.5 / 1000), atol=1e-15, rtol=0)
    # groups of ties
    z = torch.tensor([[3.0, 3.0, 3.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    for s in (0.3, 1.0, 10.0):
        np.testing.assert_allclose(sparsemax(z, s, 1).numpy(), ref_sparsemax(z.numpy(), s, 1), atol=1e-12)
    # large magnitudes: the projection is shift-invariant, the result must not lose the scale
    g = torch.Generator().manual_seed(2)
    base = torch.randn(30, 200, generator=g, dtype=torch.float64)
    for off in (1e6, -1e9):
        p = sparsemax(base + off, 2.0, 1)
        np.testing.assert_allclose(p.numpy(), ref_sparsemax(base.numpy(), 2.0, 1), atol=1e-6)
        np.testing.assert_allclose(p.sum(1).numpy(), 2.0, atol=1e-6)
    big = torch.randn(30, 200, generator=g, dtype=torch.float64) * 1e8
    np.testing.assert_allclose(sparsemax(big, 1.0, 1).numpy(), ref_sparsemax(big.numpy(), 1.0, 1), atol=1e-6)
    # one-element slices: the whole scale
    z = torch.randn(5, 1, dtype=torch.float64)
    assert torch.allclose(sparsemax(z, 0.25, 1), torch.full((5, 1), 0.25, dtype=torch.float64), atol=1e-15, rtol=0)


def test_bfloat16_and_float16():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(20, 300, generator=g)
    for dt in (torch.bfloat16, torch.float16):
        zb = z.to(dt)
        p = sparsemax(zb, 1.0, 1)
        assert p.dtype == dt
        r = ref_sparsemax(zb.double().numpy(), 1.0, 1)  # reference on the rounded input
        np.testing.assert_allclose(p.double().numpy(), r, atol=1e-2)
        zb.requires_grad_(True)
        sparsemax(zb, 1.0, 1).square().sum().backward()
        assert zb.grad.dtype == dt and torch.isfinite(zb.grad.float()).all()


def test_errors():
    z = torch.randn(3, 4)
    with pytest.raises(ValueError, match="scale"):
        sparsemax(z, -1.0)
    with pytest.raises(ValueError, match="scale"):
        sparsemax(z, torch.tensor([1.0, -2.0, 1.0]).unsqueeze(1), 1)
    with pytest.raises(ValueError, match="scale of shape"):
        sparsemax(z, torch.ones(4), 1)
    with pytest.raises(ValueError, match="empty"):
        sparsemax(torch.zeros(3, 0), 1.0, 1)
    with pytest.raises(TypeError):
        sparsemax(torch.zeros(3, 2, dtype=torch.long), 1.0, 1)


@pytest.mark.parametrize("shape,dim", [((4, 7), 1), ((7, 4), 0), ((2, 3, 5), 1), ((2, 70), 1)])
def test_gradcheck(shape, dim):
    g = torch.Generator().manual_seed(4)
    z = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    kshape = list(shape)
    kshape[dim] = 1
    s = (torch.rand(kshape, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    # the largest case (block top-k path) in fast mode (random projections) to keep the test quick
    assert torch.autograd.gradcheck(lambda a, b: sparsemax(a, b, dim), (z, s), fast_mode=z.numel() > 100)


def test_backward_closed_form_and_saved_tensors():
    """g - mean_S(g) on the support, nothing else; only a support (bool/int) is saved, never a float copy."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(50, 400, generator=g, dtype=torch.float64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        p = sparsemax(z, 1.0, 1)
    up = torch.randn(50, 400, generator=g, dtype=torch.float64)
    p.backward(up)
    S = p.detach() > 0
    expect = torch.where(S, up - (up * S).sum(1, keepdim=True) / S.sum(1, keepdim=True), 0)
    assert torch.allclose(z.grad, expect, atol=1e-12)
    big_float = [s for s in saved if s[0].is_floating_point and s[1] >= z.numel()]
    assert not big_float, saved


def test_threshold_from_sorted_candidates():
    g = torch.Generator().manual_seed(6)
    z = torch.randn(2000, 10, generator=g, dtype=torch.float64)  # slices along dim 0
    s = torch.rand(10, generator=g, dtype=torch.float64) * 3
    r = ref_sparsemax(z.numpy(), s.numpy()[None, :], 0)
    tau_true = torch.tensor([(z[:, j].numpy() - r[:, j])[r[:, j] > 0][0] for j in range(10)], dtype=torch.float64)
    srt = z.sort(0, descending=True).values
    for k in (1, 3, 50, 2000):
        tau_k, cnt = threshold_from_sorted_candidates(srt[:k], s, dim=0)
        assert (tau_k <= tau_true + 1e-12).all()  # a lower bound
        covered = srt[k - 1] <= tau_k if k < 2000 else torch.ones(10, dtype=torch.bool)
        assert torch.allclose(tau_k[covered], tau_true[covered], atol=1e-12)  # exact when covered
        assert torch.equal(cnt[covered], torch.from_numpy((r > 0).sum(0))[covered])


def _ref_tau(z3, scale):
    O, n, I = z3.shape
    z2 = z3.permute(0, 2, 1).reshape(O * I, n).double().numpy()
    r = ref_sparsemax(z2, scale.double().numpy()[:, None], 1)
    return z2, r


def _cases(g, n, S):
    """Slices (1, n, S) and scales: small and large supports, ties, one-hot, very negative, zero scale."""
    z = torch.randn(1, n, S, generator=g, dtype=torch.float64)
    z[0, :, 1] = 1.0 / 50304  # all equal (the paper's init): full support
    z[0, :, 2] = torch.randint(0, 3, (n,), generator=g).double()  # groups of ties
    z[0, :, 3] = 0.0
    z[0, 7, 3] = 1.0  # one-hot
    z[0, :, 4] = z[0, :, 4] * 1e-3 - 1e8  # very negative, tiny spread
    s = torch.rand(S, generator=g, dtype=torch.float64) * 3
    s[5] = 0.0  # zero marginal
    s[6] = 500.0  # a support of most of the slice
    s[7] = 40.0  # a support of a few hundred (far beyond the candidates)
    return z, s


@pytest.mark.parametrize("n,S,layout", [(3000, 12, "cols"), (700, 9, "rows"), (1, 8, "rows")])
def test_projector_exact_without_host_reads(n, S, layout):
    """Every slice kind gives the sort-based projection (float64, 1e-12) with no host read, and is proven exact."""
    g = torch.Generator().manual_seed(7)
    z, s = _cases(g, n, S) if n > 8 else (torch.randn(1, n, S, generator=g, dtype=torch.float64),
                                          torch.rand(S, generator=g, dtype=torch.float64))
    z3 = z if layout == "cols" else z.permute(2, 1, 0).contiguous()  # (S, n, 1): rows
    proj = SimplexProjector(s, k=8)
    with count_host_syncs() as c:
        tau, sup = proj.threshold(z3)
    assert c.total == 0, c.summary()
    assert int(proj.unproven) == 0
    z2, r = _ref_tau(z, s)
    out = np.maximum(z2 - tau.numpy()[:, None], 0)
    tol = 1e-12 * (1 + s.numpy() + np.abs(z2).max(1))  # the rounding of z - tau scales with |z|
    assert (np.abs(out - r).max(1) <= tol).all(), np.abs(out - r).max(1)
    np.testing.assert_array_equal(sup.counts.numpy(), (r > 0).sum(1))
    mask = sup.mask.reshape(n, S).numpy() if layout == "cols" else sup.mask.reshape(S, n).numpy().T
    np.testing.assert_array_equal(mask.T, r > 0)


def test_blocks_of_slices_same_result():
    """Processing the slices in cache-sized blocks (here tiny ones) gives the same thresholds and supports."""
    g = torch.Generator().manual_seed(10)
    for z3 in (torch.randn(1, 300, 37, generator=g, dtype=torch.float64), torch.randn(37, 300, 1, generator=g,
                                                                                       dtype=torch.float64)):
        s = torch.rand(37, generator=g, dtype=torch.float64) * 5
        whole = SimplexProjector(s, k=4)
        blocks = SimplexProjector(s, k=4)
        blocks.chunk = 300 * 5  # blocks of 5 slices, the last one of 2
        (t1, s1), (t2, s2) = whole.threshold(z3), blocks.threshold(z3)
        assert torch.allclose(t1, t2, atol=1e-13, rtol=0) and torch.equal(s1.mask, s2.mask)
        assert torch.equal(s1.counts, s2.counts) and int(blocks.unproven) == 0


def test_fallback_and_unproven_count():
    """Too few Newton passes: the fixed-size sort fallback finishes up to `fallback` slices exactly; the rest are
    counted in `unproven` (a device tensor) -- or finished on the host with exact=True."""
    g = torch.Generator().manual_seed(9)
    n, S = 2000, 10
    z = torch.rand(1, n, S, generator=g, dtype=torch.float64)  # uniform values: Newton needs > 6 passes
    s = torch.full((S,), 5.0, dtype=torch.float64)
    z2, r = _ref_tau(z, s)
    starved = SimplexProjector(s, k=1, iters=2, fallback=0, sort_max=0)  # the Newton path (large plans)
    tau0, _ = starved.threshold(z)
    n_bad = int(starved.unproven)
    assert n_bad > 3  # the fixture does need more passes (else this test checks nothing)
    assert (tau0 <= torch.from_numpy(z2 - r).max(1).values + 1e-9).all()  # still lower bounds
    for proj in (SimplexProjector(s, k=1, iters=2, fallback=3, sort_max=0),
                 SimplexProjector(s, k=1, iters=2, fallback=S, sort_max=0),
                 SimplexProjector(s, k=1, iters=2, fallback=0, exact=True, sort_max=0)):
        tau, sup = proj.threshold(z)
        left = int(proj.unproven)
        assert left == (n_bad - 3 if proj.fallback == 3 else 0)
        ok = ~(np.abs(np.maximum(z2 - tau.numpy()[:, None], 0) - r) > 1e-9).any(1)
        assert ok.sum() == S - left
        np.testing.assert_array_equal(sup.counts.numpy()[ok], (r > 0).sum(1)[ok])


def test_warm_bound_is_a_lower_bound_from_any_point():
    """The warm start's pass at ANY point t (below, at or above the root, past every element) gives a lower bound
    of the threshold (f is convex), the root itself when t is the root."""
    from s2t2_dist.ot.fused import k_warm, warm_bound

    g = torch.Generator().manual_seed(12)
    n, S = 500, 16
    z = torch.randn(1, n, S, generator=g, dtype=torch.float64)
    s = torch.rand(S, generator=g, dtype=torch.float64) * 3
    s[3] = 0.0  # zero scale: the root is the maximum
    z2, r = _ref_tau(z, s)
    root = torch.from_numpy((z2 - r).max(1))  # z - p = tau on the support, z <= tau off it
    rows = torch.from_numpy(z2)  # (S, n)
    starts = [root - 1, root - 1e-3, root, root + 1e-3, root + 0.5, rows.max(1).values + 1]
    for i, t in enumerate(starts):
        lb = warm_bound(t, *k_warm(rows, 1, t), s, n)
        assert (lb <= root + 1e-12).all(), (i, (lb - root).max())
        if i == 2:
            torch.testing.assert_close(lb, root, atol=1e-12, rtol=0)
    # the same bound with the slices as columns (the column kernels' blocked reductions)
    t = root + 1e-3
    torch.testing.assert_close(warm_bound(t, *k_warm(rows.t().contiguous(), 0, t), s, n),
                               warm_bound(t, *k_warm(rows, 1, t), s, n), atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["cols", "rows"])
def test_warm_start_proves_with_fewer_passes(layout):
    """A slot's previous thresholds start its next call: after a small move, one pass and 2 Newton passes prove every
    slice (the sort reference, 1e-12) where a cold start's bound and 2 passes leave slices unproven. A large move or
    an unrelated input may need more passes, but a warm start never makes a threshold wrong: what the passes do not
    prove is counted, as from a cold start."""
    g = torch.Generator().manual_seed(13)
    n, S = 3000, 12
    z = torch.rand(1, n, S, generator=g, dtype=torch.float64)  # uniform values: a cold start needs > 6 passes
    s = torch.full((S,), 5.0, dtype=torch.float64)
    as3 = (lambda x: x) if layout == "cols" else (lambda x: x.permute(2, 1, 0).contiguous())  # rows: (S, n, 1)
    moved = z + 1e-7 * torch.randn(z.shape, generator=g, dtype=torch.float64)

    cold = SimplexProjector(s, k=1, iters=2, fallback=0, sort_max=0, warm_iters=0)
    cold.threshold(as3(z), slot=0)
    cold.threshold(as3(moved), slot=0)
    assert int(cold.unproven) > 3 and not cold._warm

    warm = SimplexProjector(s, k=1, iters=2, fallback=0, sort_max=0, warm_iters=2, exact=True)
    warm.threshold(as3(z), slot=0)  # exact (host reads): the stored start is the exact threshold of z
    warm.exact = False
    tau, sup = warm.threshold(as3(moved), slot=0)  # 1 + 2 passes from z's thresholds
    assert int(warm.unproven) == 0
    z2, r = _ref_tau(moved, s)
    np.testing.assert_allclose(tau.numpy(), (z2 - r).max(1), atol=1e-12, rtol=0)
    np.testing.assert_array_equal(sup.counts.numpy(), (r > 0).sum(1))

    other = torch.randn(1, n, S, generator=g, dtype=torch.float64)  # unrelated: a bad start
    tau_o, _ = warm.threshold(as3(other), slot=0)
    left = int(warm.unproven)
    z2, r = _ref_tau(other, s)
    exact = np.abs(tau_o.numpy() - (z2 - r).max(1)) <= 1e-12
    assert (tau_o.numpy() <= (z2 - r).max(1) + 1e-12).all()  # unproven slices keep lower bounds
    assert (~exact).sum() <= left  # every inexact threshold is counted


def test_safe_inv_zero_marginals():
    """1/x for positive marginals (down to the smallest subnormal), 0 for zero ones: no inf, no NaN."""
    from s2t2_dist.ot.marginals import safe_inv

    for dt in (torch.float32, torch.float64):
        tiny = torch.finfo(dt).tiny
        x = torch.tensor([0.0, 0.25, 1e-30 if dt == torch.float32 else 1e-300, tiny / 4, 2.0], dtype=dt)
        y = safe_inv(x)
        assert torch.isfinite(y).all() and y[0] == 0 and y[1] == 4 and y[4] == 0.5
        assert y[3] == 1 / tiny  # a subnormal marginal is clamped to the smallest normal, not inverted to inf
