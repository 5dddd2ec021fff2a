"""s2t2_dist.ot.sparsemax, the scaled sparsemax of the public API, against autograd through a sort-based sparsemax
(tests/helpers/sinkhorn_reference.py): values and gradients in float64, every shape and dim, ties, scale 0, per-slice
scales and their gradient; float32 to float32's precision. On a CPU it takes the torch route; the CUDA route is
the same call under Triton's interpreter (tests/helpers/scripts/sinkhorn_triton_interpreted.py)."""
import pytest
import torch

from s2t2_dist.ot import sparsemax
from tests.helpers.sinkhorn_reference import edge_problem, sort_sparsemax


def _ref(z, scale, dim):
    """The sort reference for any shape: slices moved last and flattened to rows."""
    zm = z.movedim(dim, -1)
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale), dtype=z.dtype)
    s = s.expand(zm.shape[:-1]).reshape(-1)
    return sort_sparsemax(zm.reshape(-1, zm.shape[-1]), s, 1).reshape(zm.shape).movedim(-1, dim)


def _both(z, scale, dim, seed=0):
    """(value, dz, dscale) of sparsemax and of the reference, for one random upstream gradient."""
    G = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed), dtype=z.dtype)
    out = []
    for f in (sparsemax, _ref):
        zz = z.clone().requires_grad_(True)
        ss = scale.clone().requires_grad_(True) if isinstance(scale, torch.Tensor) else scale
        p = f(zz, ss, dim)
        (p * G).sum().backward()
        out.append((p.detach(), zz.grad, ss.grad if isinstance(ss, torch.Tensor) else None))
    return out


@pytest.mark.parametrize("shape,dim", [((40, 7), 0), ((40, 7), 1), ((7, 40), -1), ((3, 5, 11), 1), ((13,), 0),
                                       ((2, 3, 4, 9), -1)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_equals_the_sort_reference_in_float64(shape, dim, scale):
    z = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + dim), dtype=torch.float64)
    (p, gz, _), (pr, gzr, _) = _both(z, scale, dim)
    assert torch.allclose(p, pr, rtol=0, atol=1e-12)
    assert torch.allclose(gz, gzr, rtol=0, atol=1e-10)
    assert torch.allclose(p.sum(dim), torch.full_like(p.sum(dim), scale), atol=1e-12)  # on the scaled simplex
    assert (p >= 0).all() and (p == 0).any()  # sparse: some entries exactly zero


def test_ties_one_hot_very_negative_and_zero_scales():
    C, mu, nu = edge_problem()
    for dim, scale in ((0, nu), (1, mu)):  # per-slice scales, with a zero among them
        (p, gz, gs), (pr, gzr, gsr) = _both(C, scale, dim, seed=dim)
        assert torch.allclose(p, pr, rtol=0, atol=1e-12)
        assert torch.allclose(gz, gzr, rtol=0, atol=1e-10)
        zero = scale == 0
        assert torch.allclose(gs[~zero], gsr[~zero], rtol=0, atol=1e-10)  # d/dscale = mean of g over the support
        # a zero scale: a zero slice, no support, and 0 for its scale's gradient (the sort's picks its largest entry)
        assert (p.index_select(1 - dim, zero.nonzero().flatten()) == 0).all() and (gs[zero] == 0).all()


def test_float32_and_the_public_contract():
    z = torch.randn(50, 30, generator=torch.Generator().manual_seed(3))
    p = sparsemax(z, 2.0, dim=0)
    assert p.dtype == torch.float32 and p.shape == z.shape
    assert torch.allclose(p, _ref(z.double(), 2.0, 0).float(), atol=1e-6)
    assert torch.equal(sparsemax(torch.zeros(0, 4), 1.0, 1), torch.zeros(0, 4))  # no slices: nothing to do
    big = torch.tensor([[0.0, 10.0, 0.0]])
    assert torch.equal(sparsemax(big, 1.0), torch.tensor([[0.0, 1.0, 0.0]]))  # one dominant entry: one-hot
    for bad, match in ((-1.0, "scale must be"), (float("nan"), "scale must be"), (torch.ones(3), "one value per slice")):
        with pytest.raises(ValueError, match=match):
            sparsemax(torch.ones(2, 5), bad, dim=1)
    with pytest.raises(ValueError, match="empty"):
        sparsemax(torch.ones(3, 0), 1.0, dim=1)
