"""Scaled sparsemax against an independent sort-based numpy reference; closed-form backward; building blocks."""
import numpy as np
import pytest
import torch

from s2t2_dist.ot.simplex import (
    SimplexProjector,
    block_topk,
    michelot_partials,
    michelot_refine,
    sparsemax,
    threshold_from_sorted_candidates,
)


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


def test_threshold_building_blocks():
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
        # Michelot from that lower bound reaches the exact threshold
        t, c = michelot_refine(z, tau_k, s, 0, None)
        assert torch.allclose(t, tau_true, atol=1e-12)
        assert torch.equal(c, torch.from_numpy((r > 0).sum(0)))
    ssum, cnt = michelot_partials(z, tau_true.unsqueeze(0), 0)
    assert torch.allclose((ssum - s) / cnt, tau_true, atol=1e-12)


@pytest.mark.parametrize("n,k", [(10, 3), (65, 1), (1000, 16), (5003, 40)])
def test_block_topk_exact(n, k):
    g = torch.Generator().manual_seed(n)
    for z3 in (torch.randn(1, n, 7, generator=g), torch.randn(6, n, 1, generator=g),
               torch.randint(0, 4, (2, n, 3), generator=g).float()):  # heavy ties
        vals, fidx = block_topk(z3.contiguous(), k)
        ref = z3.topk(k, dim=1).values.permute(1, 0, 2).reshape(k, -1)
        assert torch.equal(vals, ref)
        assert torch.equal(z3.reshape(-1)[fidx], vals)  # indices point at those values
        assert all(len(set(fidx[:, s].tolist())) == k for s in range(fidx.shape[1]))


def _ref_tau(z3, scale):
    O, n, I = z3.shape
    z2 = z3.permute(0, 2, 1).reshape(O * I, n).double().numpy()
    r = ref_sparsemax(z2, scale.double().numpy()[:, None], 1)
    return z2, r


@pytest.mark.parametrize("case", ["topk", "full", "second_round", "michelot", "mask", "mixed"])
def test_projector_paths(case):
    """Every code path of SimplexProjector.threshold gives the reference projection and a correct support."""
    g = torch.Generator().manual_seed(7)
    n, S = 3000, 12
    kw = {}
    if case == "topk":
        z = torch.randn(1, n, S, generator=g, dtype=torch.float64)
        s = torch.full((S,), 0.5, dtype=torch.float64)
    elif case == "full":
        z = torch.rand(1, n, S, generator=g, dtype=torch.float64) * 1e-3 + 1.0
        s = torch.full((S,), 10.0, dtype=torch.float64)
    elif case in ("second_round", "michelot"):
        z = torch.randn(1, n, S, generator=g, dtype=torch.float64)
        s = torch.full((S,), 80.0, dtype=torch.float64)  # supports of a few hundred
        kw = {"max_k2": 5000 if case == "second_round" else 8}
    elif case == "mask":
        z = torch.randn(1, n, S, generator=g, dtype=torch.float64)
        s = torch.full((S,), 1500.0, dtype=torch.float64)  # supports of most of the slice
    else:  # mixed: half the slices full
        z = torch.randn(1, n, S, generator=g, dtype=torch.float64) * 1e-3
        s = torch.cat([torch.full((S // 2,), 0.01), torch.full((S - S // 2,), 100.0)]).double()
    proj = SimplexProjector(s, k=8, **kw)
    tau, sup = proj.threshold(z)
    z2, r = _ref_tau(z, s)
    expected_kind = {"topk": "sparse", "full": "full", "second_round": "sparse", "michelot": "sparse",
                     "mask": "mask", "mixed": "mixed"}[case]
    assert sup.kind == expected_kind, (sup.kind, proj.stats)
    if case == "second_round":
        assert proj.stats["second_round"] == S
    if case == "michelot":
        assert proj.stats["michelot"] == S
    out = np.maximum(z2 - tau.numpy()[:, None], 0)
    np.testing.assert_allclose(out, r, atol=1e-10)
    np.testing.assert_array_equal(sup.counts.numpy(), (r > 0).sum(1))
    # the support representation marks exactly the positive entries
    mask = np.zeros(z.numel(), dtype=bool)
    if sup.kind == "full":
        mask[:] = True
    elif sup.kind == "mask":
        mask = sup.mask.reshape(-1).numpy()
    else:
        mask[sup.idx.numpy()] = True
        if sup.kind == "mixed":
            mask.reshape(n, S)[:, sup.full.numpy()] = True
    np.testing.assert_array_equal(mask.reshape(n, S).T, r > 0)


def test_warm_start_same_result():
    """With a remembered guess (inplace_ok) the thresholds are bit-identical to a cold start and z is restored."""
    g = torch.Generator().manual_seed(8)
    z = torch.randn(500, 300, 1, generator=g)
    s = torch.rand(500, generator=g)
    warm = SimplexProjector(s, k=8)
    warm.threshold(z.clone(), inplace_ok=True)
    for step in range(3):
        z2 = z + 0.3 * torch.randn(z.shape, generator=g)  # the support moves
        before = z2.clone()
        t_w, s_w = warm.threshold(z2, inplace_ok=True)
        assert torch.equal(z2, before)
        t_c, s_c = SimplexProjector(s, k=8).threshold(z2)
        assert warm.stats["warm"]
        assert torch.equal(t_w, t_c) and s_w.kind == s_c.kind
        assert torch.equal(s_w.idx, s_c.idx) and torch.equal(s_w.counts, s_c.counts)
