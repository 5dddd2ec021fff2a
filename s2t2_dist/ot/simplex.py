"""The scaled sparsemax (the paper's Algorithm 2): the Euclidean projection of every slice of a tensor onto
``{p >= 0, sum p = scale}``, exact and differentiable.

Pure math: no torch.distributed, no I/O. It runs on the sparse Sinkhorn's per-device route
(:func:`s2t2_dist.ot.routing.steps_for`): the thresholds by the Triton kernel on CUDA, by Newton steps in torch
ops on a CPU, both exact (each slice iterates until its support stops shrinking); the backward by the route's
projection backward. A projection is ``max(z - t, 0)`` with ``t`` the slice's threshold; its Jacobian is
``h -> S * (h - mean_S h)`` on the support S, and the derivative in the scale is ``1 / |S|`` on S.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .dykstra import compute_dtype
from .routing import steps_for

__all__ = ["sparsemax"]


def _slice_scales(scale: float | Tensor, lead: torch.Size, z: Tensor) -> Tensor:
    """``scale`` as one value per slice, shape ``lead`` (z's shape without the projected dim), checked (>= 0,
    finite). A tensor may be a scalar, of shape ``lead``, or broadcastable to it."""
    if not isinstance(scale, Tensor):
        s = float(scale)
        if not (math.isfinite(s) and s >= 0):
            raise ValueError(f"sparsemax: scale must be a finite number >= 0, got {scale}")
        return torch.full(lead, s, dtype=compute_dtype(z.dtype), device=z.device)
    try:
        st = scale.to(z.device).expand(lead)
    except RuntimeError:
        raise ValueError(f"sparsemax: scale of shape {tuple(scale.shape)} is not one value per slice (expected "
                         f"{tuple(lead)}, or broadcastable to it)") from None
    sd = st.detach()
    if sd.numel() and not bool((torch.isfinite(sd) & (sd >= 0)).all()):  # one host read per call: not a training op
        raise ValueError("sparsemax: scale must be finite and >= 0 in every slice")
    return st


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z: Tensor, s: Tensor):
        cdt = compute_dtype(Z.dtype)
        Zc = Z.detach().to(cdt).contiguous()
        sc = s.detach().to(cdt).contiguous()
        steps = steps_for(Z.device, sc, sc)
        tau, _ = steps.thresholds(Zc, sc, 1)
        t = tau.to(cdt).unsqueeze(1)
        mask = Zc > t
        ctx.steps, ctx.in_dtype, ctx.scale_dtype = steps, Z.dtype, s.dtype
        # the count from the mask itself, so the backward's mean is over exactly the entries that got mass
        ctx.save_for_backward(mask, mask.sum(1, dtype=torch.int32))
        return (Zc - t).clamp_(min=0).to(Z.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        mask, cnt = ctx.saved_tensors
        gc = g.to(compute_dtype(ctx.in_dtype)).contiguous()
        gz = ctx.steps.row_bwd(gc, None, mask, cnt).to(ctx.in_dtype) if ctx.needs_input_grad[0] else None
        gs = None
        if ctx.needs_input_grad[1]:
            gs = ((gc * mask).sum(1) / cnt.clamp(min=1).to(gc.dtype)).to(ctx.scale_dtype)
        return gz, gs


def sparsemax(z: Tensor, scale: float | Tensor = 1.0, dim: int = -1) -> Tensor:
    """Euclidean projection of every slice of ``z`` along ``dim`` onto ``{p >= 0, sum p = scale}`` (the scaled
    sparsemax; ``scale`` 1 is sparsemax).

    ``scale``: a number >= 0, or a tensor of one value per slice (z's shape without ``dim``, or broadcastable to
    it). Any shape and float dtype: float64 is computed in float64, the others in float32, and the result has z's
    dtype. Exact (no iteration cap, no tolerance); scale 0 gives zeros. Differentiable in ``z`` (``g - mean_S g``
    on the support S, 0 elsewhere) and in a tensor ``scale`` (``mean_S g``; 0 where the scale is 0). Runs where ``z`` is: the Triton
    kernels on CUDA, torch ops on a CPU. Not checked (a full pass): NaN or inf in ``z``."""
    if not isinstance(z, Tensor):
        raise TypeError(f"sparsemax: z must be a tensor, got {type(z).__name__}")
    if z.dim() == 0:
        raise ValueError("sparsemax: z must have at least one dimension")
    dim = dim % z.dim()
    zm = z.movedim(dim, -1)
    lead, n = zm.shape[:-1], zm.shape[-1]
    s = _slice_scales(scale, lead, z)
    if n == 0 and math.prod(lead):
        raise ValueError(f"sparsemax: slices along dim={dim} are empty (shape {tuple(z.shape)}): no projection")
    if z.numel() == 0:
        return z.clone()
    out = _Sparsemax.apply(zm.reshape(-1, n), s.reshape(-1))
    return out.reshape(zm.shape).movedim(-1, dim)
