"""The sparse kind's weight floor as one in-place autograd Function equals the plain-autograd reference."""
import pytest
import torch

from s2t2_dist.ot.sinkhorn import SparseSinkhorn
from s2t2_dist.translator.floor import floor_plan, floor_plan_reference


def _plan_with_edge_columns(v=120, u=12, seed=0):
    """A feasible-looking P (v x u) with: a flat column (every entry nu_j / v) whose C column is not flat, a flat
    column whose C column is flat too, a zero-marginal column, a column with a tie at C's maximum, and
    ordinary sparse columns."""
    g = torch.Generator().manual_seed(seed)
    nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.1
    nu[3] = 0.0
    nu /= nu.sum()
    P = torch.rand(v, u, generator=g, dtype=torch.float64) ** 8  # many small entries, a few large
    P = P * (nu / P.sum(0))
    C = torch.randn(v, u, generator=g, dtype=torch.float64) * 1e-3
    P[:, 0] = nu[0] / v  # flat, C not flat: one-hot at C's argmax
    P[:, 1] = nu[1] / v
    C[:, 1] = 0.5  # flat, C flat too: stays uniform
    P[:, 3] = 0.0  # zero marginal
    C[7, 5] = C[11, 5] = C[:, 5].max() + 1.0  # a tie at the maximum: the first one wins
    return P, C, nu


@pytest.mark.parametrize("floor", [0.5, 1.0, 4.0])
def test_floor_function_equals_reference_value_and_gradient(floor):
    P0, C, nu = _plan_with_edge_columns()
    up = torch.randn(P0.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    a, b = P0.clone().requires_grad_(True), P0.clone().requires_grad_(True)
    out_a = floor_plan(a * 1.0, C, nu, floor)  # (a fresh non-leaf tensor: the Function works in place)
    out_b = floor_plan_reference(b * 1.0, C, nu, floor)
    assert torch.equal(out_a > 0, out_b > 0)
    torch.testing.assert_close(out_a, out_b, rtol=1e-14, atol=0)
    assert torch.equal(out_a[:, 0] > 0, torch.arange(P0.shape[0]) == C[:, 0].argmax())  # one-hot
    assert torch.equal(out_a[:, 5] > 0, out_b[:, 5] > 0) and int((out_a[:, 3] != 0).sum()) == 0
    out_a.backward(up)
    out_b.backward(up)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-14)
    assert float(a.grad[:, 0].abs().sum()) == 0.0  # a flat column passes no gradient


def test_floor_after_the_solver_equals_reference():
    """In place on the sparse Sinkhorn's output (the way SparseKind uses it): P and dC as the reference."""
    g = torch.Generator().manual_seed(3)
    v, u = 200, 30
    C = 1.0 / v + 3e-3 * torch.randn(v, u, generator=g, dtype=torch.float64)
    mu = torch.full((v,), 1.0 / v, dtype=torch.float64)
    nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.1
    nu /= nu.sum()
    up = torch.randn(v, u, generator=g, dtype=torch.float64)
    a, b = C.clone().requires_grad_(True), C.clone().requires_grad_(True)
    Pa = floor_plan(SparseSinkhorn(mu, nu)(a, 3), a, nu, 1.0)
    Pb = floor_plan_reference(SparseSinkhorn(mu, nu)(b, 3), b, nu, 1.0)
    assert torch.equal(Pa > 0, Pb > 0) and 0 < int((Pa > 0).sum()) < v * u
    torch.testing.assert_close(Pa, Pb, rtol=1e-14, atol=0)
    Pa.backward(up)
    Pb.backward(up)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-14)


def test_first_row_of_max_is_argmax_with_ties_first():
    from s2t2_dist.translator.floor import first_row_of_max

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        C = torch.randint(0, 4, (301, 17), generator=g).to(dtype)  # many ties in every column
        C[:, 3] = 2.0  # a constant column: row 0
        C[-1, 5] = 9.0  # the maximum on the last row
        assert torch.equal(first_row_of_max(C, C.amax(0)), C.argmax(0)), dtype
        R = torch.randn(1000, 33, generator=g, dtype=dtype)
        assert torch.equal(first_row_of_max(R, R.amax(0)), R.argmax(0))
