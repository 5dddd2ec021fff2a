"""Dykstra's alternating projections with scaled-sparsemax projections (the paper's Algorithm 1), as one autograd
Function over per-device steps.

Pure math: no torch.distributed, no I/O. ``C`` is (v, u): source tokens x target tokens; ``mu`` (v) and ``nu`` (u)
are the scales of the row and column projections onto ``{p >= 0, sum p = scale}``::

    X_0 = C, P_0 = Q_0 = 0
    for k in range(n_iter):
        A = X_k + P_k;  Y = R(A);  P_{k+1} = A - Y = min(A, t_row)
        B = Y + Q_k;    X_{k+1} = K(B);  Q_{k+1} = B - X_{k+1} = min(B, t_col)
    return X_{n_iter}

A projection of a slice z is ``max(z - t, 0)`` with ``t`` its exact threshold; its Jacobian is
``h -> S * (h - mean_S h)`` on the support S. Only the supports (bool masks) and their counts are saved, and the
backward runs the adjoint recursion in closed form::

    gB = where(S_K, gX - mean_S_K(gX - gQ), gQ);  gA = where(S_R, gB - mean_S_R(gB - gP), gP);  gX = gP = gA

from gX = grad_output, gP = gQ = 0; the gradient of C is the first iteration's gA.

The steps are chosen per device by :mod:`s2t2_dist.ot.routing` (``steps_for``): on CUDA the Triton kernels of
:mod:`s2t2_dist.ot.dykstra_triton` (one launch per projection, nothing read back to the host); on a CPU the plain
torch steps below, the same algorithm in torch ops (:func:`newton_thresholds`). Both are exact at every size. The
column-sharded solver (``s2t2_dist.distributed.sharded_sinkhorn``) replaces the row steps with its own (rows span
ranks).
"""
from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

__all__ = ["MAX_SIDE", "TorchSteps", "apply_projection", "check_plan_shape", "compute_dtype", "dykstra",
           "newton_thresholds", "projection_backward", "sum64"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    if not dtype.is_floating_point:
        raise TypeError(f"the sparse Sinkhorn needs a floating point tensor, got dtype {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


#: float32 block length of :func:`sum64`: each block's rounding is a few ulp of its own sum, far below the float32
#: rounding the thresholds get when they are applied.
SUM_BLOCK = 64


def sum64(x: Tensor, dim: int) -> Tensor:
    """float64 sums of ``x`` along ``dim``. float32 is summed in float32 blocks of :data:`SUM_BLOCK` first, then in
    float64: on a CPU a float64-accumulating sum of float32 costs ~10x a float32 one (a cast per element)."""
    if x.dtype == torch.float64:
        return x.sum(dim)
    n = x.shape[dim]
    nb = n // SUM_BLOCK
    out = x.narrow(dim, nb * SUM_BLOCK, n - nb * SUM_BLOCK).sum(dim, dtype=torch.float64)
    if nb:
        shape = list(x.shape)
        shape[dim: dim + 1] = [nb, SUM_BLOCK]
        out += x.narrow(dim, 0, nb * SUM_BLOCK).reshape(shape).sum(dim + 1).sum(dim, dtype=torch.float64)
    return out


#: Newton steps run on the slices still moving once they are at most this share of all (a gather of them costs about
#: one of a step's five passes over them).
COMPACT_SHARE = 0.75


def newton_thresholds(Z: Tensor, scale: Tensor, dim: int, sums=sum64) -> tuple[Tensor, Tensor]:
    """The exact threshold of every slice of ``Z`` (2-D, a CPU tensor) along ``dim`` (float64) and its support size.

    The CUDA kernels' algorithm in torch ops: from the lower bounds ``max z - s`` and ``(sum z - s) / n``, Newton
    steps ``t <- t + (sum_{z > t} (z - t) - s) / |{z > t}|`` while a slice's support still shrinks; a slice whose
    support stops shrinking has the threshold of its own support, i.e. the exact one. The loop's flag is read from
    CPU memory (numpy: no device, so no sync for the counter of ``utils.syncs`` to see).

    A step makes 5 passes over its slices: ``r = max(z - t, 0)`` into one scratch matrix, its sums, ``sign(r)`` in
    place, and the support counts as sums of those 0/1 values (exact integers in float32 below 2**24 entries per
    slice; a bool mask's count is ~10x slower on a CPU). Slices that stopped moving are dropped from later steps
    once few enough remain (:data:`COMPACT_SHARE`): most take 2-3 steps, a few up to 7. ``sums``: the float64
    slice sums (:func:`sum64`; another order gives another float32 rounding, as another device's would)."""
    n, m = Z.shape[dim], Z.shape[1 - dim]
    if n >= 2 ** 24:
        raise ValueError(f"a slice of {n} entries: the float32 support count is exact below 2**24")
    s = scale.to(torch.float64).expand(m)
    tau = torch.maximum(Z.amax(dim).double() - s, (sums(Z, dim) - s) / max(n, 1))
    prev = torch.full((m,), n + 1, dtype=torch.int64, device=Z.device)
    idx, Zs = None, Z  # the slices still stepped (None: all, always so in the first step) and their entries
    r = torch.empty_like(Z, memory_format=torch.contiguous_format)
    while True:
        t, sc, pv = (tau, s, prev) if idx is None else (tau[idx], s[idx], prev[idx])
        # > 0 exactly where z > t (IEEE subtraction)
        torch.sub(Zs, t.to(Z.dtype).unsqueeze(dim), out=r).clamp_(min=0)
        excess = sums(r, dim) - sc
        c = torch.sign(r, out=r).sum(dim).to(torch.int64)
        act = c < pv
        t = torch.where(act, t + excess / c.clamp(min=1), t)
        pv = torch.where(act, c, pv)
        if idx is None:
            cnt, tau, prev = c, t, pv
        else:
            cnt[idx], tau[idx], prev[idx] = c, t, pv
        # (on a GPU, only as the CUDA route's fallback: then a host read per step)
        moving = np.flatnonzero(act.numpy() if act.device.type == "cpu" else act.cpu().numpy())
        if moving.size == 0:
            return tau, cnt
        if moving.size <= COMPACT_SHARE * act.numel():
            sel = torch.from_numpy(moving).to(Z.device)
            idx = sel if idx is None else idx[sel]
            Zs = Z.index_select(1 - dim, idx)
            r = torch.empty_like(Zs)


def apply_projection(A: Tensor, tau: Tensor, dim: int, corr: Tensor, pos: Tensor, add: Tensor | None = None
                     ) -> Tensor:
    """One projection given its thresholds: ``pos <- max(A - t, 0) (+ add)``, ``corr <- min(A, t)`` (Dykstra's
    correction), and the support ``A > t`` returned (bool). ``corr``/``pos`` may be ``A``'s or ``add``'s buffers."""
    t = tau.to(A.dtype).unsqueeze(dim)
    mask = A > t
    if add is None and pos is not A:  # straight into pos, while A is intact (corr may be A)
        torch.sub(A, t, out=pos).clamp_(min=0)
        torch.minimum(A, t, out=corr)
        return mask
    y = (A - t).clamp_(min=0)
    torch.minimum(A, t, out=corr)
    if add is None:
        pos.copy_(y)
    elif pos is add:
        pos.add_(y)
    else:
        torch.add(y, add, out=pos)
    return mask


def projection_backward(g: Tensor, gc: Tensor | None, mask: Tensor, counts: Tensor, dim: int,
                        reduce=None) -> Tensor:
    """``where(S, g - mean_S(g - gc), gc)`` per slice along ``dim`` (``gc`` None: 0), a new tensor. ``reduce``:
    applied to the per-slice sums first (the sharded rows' all-reduce)."""
    h = (g * mask) if gc is None else (g - gc).mul_(mask)  # one matrix, reused below (allocations page-fault)
    sums = h.sum(dim)
    if reduce is not None:
        sums = reduce(sums)
    mean = sums / counts.clamp(min=1).to(sums.dtype)
    torch.sub(g, mean.unsqueeze(dim).to(g.dtype), out=h)
    return h.mul_(mask) if gc is None else torch.where(mask, h, gc, out=h)


class TorchSteps:
    """The steps in plain torch ops, on a CPU: thresholds by :func:`newton_thresholds` (its slice sums ``sums``),
    exact."""

    def __init__(self, mu: Tensor, nu: Tensor, sums=sum64):
        self.mu, self.nu, self.sums = mu, nu, sums

    @staticmethod
    def buffers(C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(torch.empty_like(C, memory_format=torch.contiguous_format) for _ in range(3))

    def thresholds(self, Z: Tensor, scale: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        return newton_thresholds(Z, scale, dim, self.sums)

    def row(self, src: Tensor, Pc: Tensor, Qc: Tensor, first: bool) -> tuple[Tensor, Tensor]:
        A = src if first else src + Pc
        tau, cnt = newton_thresholds(A, self.mu, 1, self.sums)
        return apply_projection(A, tau, 1, Pc, Qc, None if first else Qc), cnt

    def col(self, Qc: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
        tau, cnt = newton_thresholds(Qc, self.nu, 0, self.sums)
        return apply_projection(Qc, tau, 0, Qc, X), cnt

    @staticmethod
    def row_bwd(g: Tensor, gP: Tensor | None, mask: Tensor, cnt: Tensor) -> Tensor:
        return projection_backward(g, gP, mask, cnt, 1)

    @staticmethod
    def col_bwd(g: Tensor, gQ: Tensor | None, mask: Tensor, cnt: Tensor) -> Tensor:
        return projection_backward(g, gQ, mask, cnt, 0)


#: the largest slice either route takes: the torch steps count a support exactly in float32 below 2**24 entries
MAX_SIDE = 2 ** 24 - 1


def check_plan_shape(v: int, u: int) -> None:
    """One line (``ValueError``) when a v x u plan is beyond what the routes support, before any work."""
    for name, n in (("v (source tokens)", v), ("u (target tokens)", u)):
        if n > MAX_SIDE:
            raise ValueError(f"the sparse Sinkhorn supports at most {MAX_SIDE:,} tokens a side, got {name} = {n:,}")


class _Dykstra(torch.autograd.Function):
    @staticmethod
    def forward(ctx, C: Tensor, steps, n_iter: int):
        cdt = compute_dtype(C.dtype)
        src = C.detach().to(cdt)
        Pc, Qc, X = steps.buffers(src)
        saved = []
        for k in range(n_iter):
            saved += steps.row(src if k == 0 else X, Pc, Qc, k == 0)
            saved += steps.col(Qc, X)
        ctx.steps, ctx.n_iter, ctx.in_dtype = steps, n_iter, C.dtype
        ctx.save_for_backward(*saved)  # (mask, count) per projection: rows, columns, rows, ...
        return X if X.dtype == C.dtype else X.to(C.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        saved, steps = ctx.saved_tensors, ctx.steps
        gX = g.to(compute_dtype(ctx.in_dtype))
        gP = gQ = None
        for k in reversed(range(ctx.n_iter)):
            gQ = steps.col_bwd(gX, gQ, saved[4 * k + 2], saved[4 * k + 3])
            gP = steps.row_bwd(gQ, gP, saved[4 * k], saved[4 * k + 1])
            gX = gP
        return gP.to(ctx.in_dtype), None, None


def dykstra(C: Tensor, steps, n_iter: int = 3) -> Tensor:
    """Algorithm 1 on ``C`` (v, u) with the projections of ``steps`` (:func:`steps_for`, or the column-sharded
    solver's); differentiable in ``C``. Nothing is checked here (see ``sinkhorn.validate_plan_inputs``)."""
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    return _Dykstra.apply(C, steps, int(n_iter))
