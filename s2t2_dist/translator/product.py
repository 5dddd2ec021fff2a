"""The translated rows' product ``P^T M`` (u x d from a v x u plan and v source rows), one kernel per device.

Pure math: no torch.distributed, no I/O. :func:`plan_product` is what :func:`~s2t2_dist.translator.module.
translated_rows` multiplies with. It is one dispatcher op (``torch.library.custom_op``) with two kernels:

* CUDA: for a sparse plan (``sparse``: the sparse kind's) the Triton kernels of
  :mod:`~s2t2_dist.translator.product_triton`, which find and count P's LIVE rows (any non-zero) on the device
  and read nothing back (the shipped plan at v = 50,280 has ~320 live rows: the two v x u x d GEMMs shrink to
  that many rows); for the other kinds the dense GEMMs. Should Triton fail to compile on a device, one warning and
  the GEMMs from then on.
* CPU: the live rows gathered (a host read, free on a CPU) when at most :data:`DENSE_FRACTION` of the rows are
  live, else the GEMMs.

The kernels agree up to rounding (the same terms summed in another order) in the forward and in ``dM``. ``dP``
differs only where it is never read: with ``sparse`` the live-row kernels leave the dead rows of dP at 0, where the
dense product has ``M_i . G_j``. That is exact for the sparse kind: P comes out of a sparsemax projection and, for
``translator.floor``, the floor Function, and both backwards read the incoming gradient only on P's support
(``J h = S * (h - mean_S h)``; the floor's ``dP_kj`` on kept entries). The other kinds' P can have zero rows whose
gradient matters (the unconstrained kind's ``C = 0`` rows): they pass ``sparse=False`` and get dP on every row.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from s2t2_dist.translator import product_triton as _triton
from s2t2_dist.utils.routes import record

log = logging.getLogger(__name__)

__all__ = ["DENSE_FRACTION", "live_rows", "plan_product", "record_route"]

#: the CPU kernel uses the dense GEMMs when more than this fraction of P's rows are live: gathering the rows then
#: saves little (at 50,280 x 512 x 2,048 on 2 threads, forward + backward: 0.5 live 1.49 s against 1.91 s dense,
#: 0.7 live 1.85 against 1.79 s)
DENSE_FRACTION = 0.5


def live_rows(P: Tensor) -> Tensor | None:
    """The indices of P's rows with a non-zero (a host read: the CPU kernel's), or None when the dense GEMMs are
    cheaper (more than :data:`DENSE_FRACTION` of the rows live)."""
    idx = P.any(1).nonzero().squeeze(1)
    return None if idx.numel() > DENSE_FRACTION * P.shape[0] else idx


_warned: list = []


def _gpu_call(live_fn, dense_fn):
    """The Triton kernel, or the dense GEMMs (with one warning) if it cannot be compiled on this device."""
    if not _warned:
        try:
            return live_fn()
        except Exception as e:  # noqa: BLE001 - a Triton compile error on an untested device: the dense form
            _warned.append(e)
            log.warning("translator product: the Triton live-row kernel failed (%s: %s); the dense GEMMs are used "
                        "from now on", type(e).__name__, e)
    return dense_fn()


def uses_live_rows(P: Tensor, sparse: bool) -> bool:
    """Whether a CUDA call takes the Triton live-row kernels: a sparse plan in float32, Triton importable."""
    return sparse and P.dtype == torch.float32 and _triton.available()


def _record_gpu(P: Tensor, sparse: bool) -> None:
    """The route a non-CPU call takes, for :mod:`s2t2_dist.utils.routes` (a sparse plan off the kernels is a
    fallback)."""
    if uses_live_rows(P, sparse) and not _warned:
        record("product", P.device, "live-row kernels", "Triton, P's live rows found on the device")
    elif not sparse:
        record("product", P.device, "dense GEMMs", "not a sparse plan (its dead rows' gradient is read)")
    else:
        why = (f"the Triton live-row kernel failed ({type(_warned[0]).__name__}: {_warned[0]})" if _warned
               else f"P is {P.dtype} (the kernels take float32)" if P.dtype != torch.float32
               else "Triton cannot be imported")
        record("product", P.device, "dense GEMMs", why, fallback=True)


def _product_gpu(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    if uses_live_rows(P, sparse):
        out = _gpu_call(lambda: _triton.live_product(P, M), lambda: P.t() @ M.to(P.dtype))
    else:
        out = P.t() @ M.to(P.dtype)
    _record_gpu(P, sparse)
    return out


def _grad_p_gpu(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    if uses_live_rows(P, sparse):
        out = _gpu_call(lambda: _triton.live_grad_p(P, M, G), lambda: M.to(P.dtype) @ G.t())
    else:
        out = M.to(P.dtype) @ G.t()
    _record_gpu(P, sparse)
    return out


def _record_cpu(P: Tensor, idx: Tensor | None) -> None:
    record("product", P.device, "dense GEMMs" if idx is None else "gathered live rows",
           f"a CPU device ({'more than' if idx is None else 'at most'} {DENSE_FRACTION:.0%} of P's rows live)")


def record_route(P: Tensor, sparse: bool) -> None:
    """Record the route a product of ``P`` takes now (:mod:`s2t2_dist.utils.routes`) without running it: what a
    run states at start-up, before its first product (which records the route it actually took)."""
    if P.device.type == "cpu":
        _record_cpu(P, live_rows(P))
    else:
        _record_gpu(P, sparse)


@torch.library.custom_op("s2t2::plan_product", mutates_args=())
def _product(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    return _product_gpu(P, M, sparse)


@_product.register_kernel("cpu")
def _product_cpu(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    idx = live_rows(P)
    _record_cpu(P, idx)
    if idx is not None:
        return P.index_select(0, idx).t() @ M.index_select(0, idx).to(P.dtype)
    return P.t() @ M.to(P.dtype)


@_product.register_fake
def _(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    return P.new_empty((P.shape[1], M.shape[1]))


@torch.library.custom_op("s2t2::plan_product_dp", mutates_args=())
def _grad_p(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    return _grad_p_gpu(P, M, G, sparse)


@_grad_p.register_kernel("cpu")
def _grad_p_cpu(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    idx = live_rows(P) if sparse else None
    if idx is None:
        return M.to(P.dtype) @ G.t()
    dP = P.new_zeros(P.shape)
    dP.index_copy_(0, idx, M.index_select(0, idx).to(P.dtype) @ G.t())
    return dP


@_grad_p.register_fake
def _(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
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
    def forward(ctx, P: Tensor, M: Tensor, sparse: bool) -> Tensor:
        ctx.save_for_backward(P, M)
        ctx.sparse = sparse
        return _product(P, M, sparse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        P, M = ctx.saved_tensors
        G = G.contiguous()
        dP = _grad_p(P, M, G, ctx.sparse) if ctx.needs_input_grad[0] else None
        dM = _grad_m(P, G).to(M.dtype) if ctx.needs_input_grad[1] else None
        return dP, dM, None


def plan_product(P: Tensor, M: Tensor, sparse: bool = False) -> Tensor:
    """``P.t() @ M`` in P's dtype (P: v x u, M: v x d, cast as read), differentiable in both, by the kernels of the
    module docstring. ``sparse``: P is the sparse kind's plan, mostly dead rows, and its consumer reads dP only on
    P's support, so the live-row kernels may leave the rows of dP where P is all zero at 0."""
    if P.dim() != 2 or M.dim() != 2 or P.shape[0] != M.shape[0]:
        raise ValueError(f"plan_product: need P (v x u) and M (v x d), got {tuple(P.shape)} and {tuple(M.shape)}")
    if P.requires_grad or M.requires_grad:
        return _PlanProduct.apply(P, M, bool(sparse))
    return _product(P, M, bool(sparse))
