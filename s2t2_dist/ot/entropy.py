"""Entropy of a transport plan: ``H(P) = -sum_ij P_ij log P_ij`` with ``0 log 0 = 0``. Pure math."""
from __future__ import annotations

import torch
from torch import Tensor

from .dykstra import compute_dtype

__all__ = ["entropy"]

_CHUNK = 1 << 22  # elements per chunk: bounds the temporaries of the forward pass


class _Entropy(torch.autograd.Function):
    """Forward: float64 accumulation over chunks (temporaries bounded by ``_CHUNK`` elements).

    Backward: ``dH/dP = -(log P + 1)`` where ``P > 0`` and ``0`` where ``P <= 0``. (The one-sided derivative at 0
    is +inf; choosing 0 there keeps the gradient finite everywhere and changes nothing for sparse plans: exact zeros
    of P are off the support of the last sparsemax, whose Jacobian discards the gradient there anyway.) Entries
    ``P < 0`` (possible only for the unconstrained baseline) contribute nothing.
    """

    @staticmethod
    def forward(ctx, P: Tensor) -> Tensor:
        flat = P.detach().reshape(-1)
        cdt = compute_dtype(P.dtype)
        acc = torch.zeros((), dtype=torch.float64, device=P.device)
        for s in range(0, flat.numel(), _CHUNK):
            x = flat[s: s + _CHUNK].to(cdt)
            acc += torch.special.xlogy(x, x).masked_fill_(x <= 0, 0).sum(dtype=torch.float64)
        ctx.save_for_backward(P)
        return (-acc).to(P.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (P,) = ctx.saved_tensors
        cdt = compute_dtype(P.dtype)
        x = P.detach().to(cdt)
        out = x.clamp(min=torch.finfo(cdt).tiny).log_().add_(1).mul_(-g.to(cdt))
        out.masked_fill_(x <= 0, 0)
        return out.to(P.dtype)


def entropy(P: Tensor) -> Tensor:
    """``H(P) = -sum P log P`` over all entries (0 log 0 = 0; negative entries ignored), a 0-d tensor.

    Differentiable with a finite gradient everywhere (0 at P = 0, see :class:`_Entropy`).
    """
    if not isinstance(P, Tensor) or not P.dtype.is_floating_point:
        raise TypeError(f"entropy: P must be a floating point tensor, got {type(P).__name__}")
    return _Entropy.apply(P)
