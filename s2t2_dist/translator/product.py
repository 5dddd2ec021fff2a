"""The translated rows' product ``P^T M`` (u x d from a v x u plan and v source rows), per-device kernels.

Pure math: no torch.distributed, no I/O. :func:`plan_product` is what :func:`~s2t2_dist.translator.module.
translated_rows` multiplies with. It is one dispatcher op (``torch.library.custom_op``) with two kernels:

* CPU: only the LIVE rows of P (any non-zero) are read: ``P[live]^T M[live]`` forward, ``M[live] G^T`` into
  those rows of dP backward. The shipped sparse recipe's plan at v = 50,280 (the FVT start with its own source
  marginal) has ~320 live rows: the two GEMMs of v x u x d (211 GFLOP per step at OLMo-1B's d, ~1.1 s on 2 CPU
  threads, most of the translator) become ~0.6% of that. Finding the live rows reads P on the host, which on a CPU
  is no sync; a plan whose rows are mostly live (over :data:`DENSE_FRACTION`) takes the dense GEMMs.
* every other device (CUDA): the dense GEMMs. Finding live rows there is a ``nonzero``, a device -> host read in
  every step; the dense product has none.

The two agree up to rounding (the same terms summed in another order) in the forward and in ``dM``. ``dP`` differs
only where it is never read: with ``support_grad`` (the sparse kind) the CPU kernel leaves the dead rows of dP at
0, where the dense product has ``M_i . G_j``. That is exact for the sparse kind: P comes out of a sparsemax
projection and, for ``translator.floor``, the floor Function, and both backwards read the incoming gradient only
on P's support (``J h = S * (h - mean_S h)``; the floor's ``dP_kj`` on kept entries), which lies in the live rows.
The other kinds' P can have zero rows whose gradient matters (the unconstrained kind's ``C = 0`` rows): they pass
``support_grad=False`` and get dP on every row.

A :class:`~s2t2_dist.utils.syncs.SyncCounter` sees this op as one op (a kernel, like any aten op that reads its
own data on the CPU), not the CPU kernel's ``nonzero``: the CUDA kernel is the one a GPU runs, and it has none.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["DENSE_FRACTION", "plan_product", "live_rows"]

#: the CPU kernel uses the dense GEMMs when more than this fraction of P's rows are live: gathering the rows then
#: costs more than the zero rows it skips (at 50,280 x 512 x 2,048 on 2 threads the two meet near 0.6-0.8)
DENSE_FRACTION = 0.5


def live_rows(P: Tensor) -> Optional[Tensor]:
    """The indices of P's rows with a non-zero (a host read: the CPU kernel's), or None when the dense GEMMs are
    cheaper (more than :data:`DENSE_FRACTION` of the rows live)."""
    idx = P.any(1).nonzero().squeeze(1)
    return None if idx.numel() > DENSE_FRACTION * P.shape[0] else idx


# M may be in another dtype than P (a bf16 model's rows): the kernels cast what they read, so the CPU kernel casts
# only the live rows, not a v x d copy per step

@torch.library.custom_op("s2t2::plan_product", mutates_args=())
def _product(P: Tensor, M: Tensor) -> Tensor:
    return P.t() @ M.to(P.dtype)


@_product.register_kernel("cpu")
def _product_cpu(P: Tensor, M: Tensor) -> Tensor:
    idx = live_rows(P)
    if idx is None:
        return P.t() @ M.to(P.dtype)
    return P.index_select(0, idx).t() @ M.index_select(0, idx).to(P.dtype)


@_product.register_fake
def _(P: Tensor, M: Tensor) -> Tensor:
    return P.new_empty((P.shape[1], M.shape[1]))


@torch.library.custom_op("s2t2::plan_product_dp", mutates_args=())
def _grad_p(P: Tensor, M: Tensor, G: Tensor, support_grad: bool) -> Tensor:
    return M.to(P.dtype) @ G.t()


@_grad_p.register_kernel("cpu")
def _grad_p_cpu(P: Tensor, M: Tensor, G: Tensor, support_grad: bool) -> Tensor:
    idx = live_rows(P) if support_grad else None
    if idx is None:
        return M.to(P.dtype) @ G.t()
    dP = P.new_zeros(P.shape)
    dP.index_copy_(0, idx, M.index_select(0, idx).to(P.dtype) @ G.t())
    return dP


@_grad_p.register_fake
def _(P: Tensor, M: Tensor, G: Tensor, support_grad: bool) -> Tensor:
    return P.new_empty(P.shape)


@torch.library.custom_op("s2t2::plan_product_dm", mutates_args=())
def _grad_m(P: Tensor, G: Tensor) -> Tensor:
    return P @ G


@_grad_m.register_kernel("cpu")
def _grad_m_cpu(P: Tensor, G: Tensor) -> Tensor:
    idx = live_rows(P)
    if idx is None:
        return P @ G
    dM = G.new_zeros((P.shape[0], G.shape[1]))  # a dead row of P gives its source row no gradient, exactly
    dM.index_copy_(0, idx, P.index_select(0, idx) @ G)
    return dM


@_grad_m.register_fake
def _(P: Tensor, G: Tensor) -> Tensor:
    return G.new_empty((P.shape[0], G.shape[1]))


class _PlanProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, P: Tensor, M: Tensor, support_grad: bool) -> Tensor:
        ctx.save_for_backward(P, M)
        ctx.support_grad = support_grad
        return _product(P, M)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], None]:
        P, M = ctx.saved_tensors
        G = G.contiguous()
        dP = _grad_p(P, M, G, ctx.support_grad) if ctx.needs_input_grad[0] else None
        dM = _grad_m(P, G).to(M.dtype) if ctx.needs_input_grad[1] else None
        return dP, dM, None


def plan_product(P: Tensor, M: Tensor, support_grad: bool = False) -> Tensor:
    """``P.t() @ M`` in P's dtype (P: v x u, M: v x d, cast as read), differentiable in both, by the kernels of the module
    docstring. ``support_grad``: P's consumer reads dP only on P's support (the sparse kind), so the CPU kernel may
    leave the rows of dP where P is all zero at 0."""
    if P.dim() != 2 or M.dim() != 2 or P.shape[0] != M.shape[0]:
        raise ValueError(f"plan_product: need P (v x u) and M (v x d), got {tuple(P.shape)} and {tuple(M.shape)}")
    if P.requires_grad or M.requires_grad:
        return _PlanProduct.apply(P, M, bool(support_grad))
    return _product(P, M)
