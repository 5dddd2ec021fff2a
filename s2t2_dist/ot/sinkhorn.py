"""Dykstra's alternating projections (the paper's Algorithm 1) and the transport plans built on it.

Pure math: no torch.distributed, no I/O. ``C`` is (v, u): source tokens x target tokens; ``mu`` (v) and ``nu`` (u)
are the row and column marginals (non-negative, each summing to one).

* :func:`dykstra` -- Algorithm 1 with both correction terms, generic in the two projections.
* :func:`sparse_sinkhorn` -- row sparsemax (scale ``mu_i``) then column sparsemax (scale ``nu_j``); with many
  iterations it converges to ``argmin ||P - C||_F^2`` s.t. ``P >= 0, P 1 = mu, P^T 1 = nu``. Implemented by a fused
  autograd Function that saves only the supports of the 2 * n_iter projections and runs the adjoint recursion of
  Dykstra in closed form (see :class:`_ThresholdDykstra`).
* :func:`softmax_sinkhorn` -- the paper's dense baseline: scaled softmax in place of sparsemax, i.e. the KL
  (entropic) counterpart of Algorithm 1: classic Sinkhorn scaling of ``exp(C)``, run in the log domain.
* :func:`unconstrained_plan` -- ``P = C * nu`` so that the normalised weights ``P / nu`` equal ``C``.

``n_iter`` counts full (row, column) iterations: ``n_iter=3`` is the paper's "iterating 3 times" (its loop
``for k = 0..n`` runs ``n + 1`` iterations).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .fused import FusedKernels
from .native import NativeKernels, resolve_fused
from .simplex import SimplexProjector, Support, compute_dtype, sparsemax

__all__ = [
    "dykstra",
    "SparseSinkhorn",
    "sparse_sinkhorn",
    "softmax_sinkhorn",
    "log_sinkhorn",
    "unconstrained_plan",
    "validate_plan_inputs",
    "Scratch",
    "DEFAULT_ROW_K",
    "DEFAULT_COL_K",
]

# starting bounds from the maximum only: a top-k costs ~100 passes on CPU and saved no Newton pass at the S2T2
# shapes (bench/bench_sinkhorn.py, issue 21)
DEFAULT_ROW_K = 1
DEFAULT_COL_K = 1

Projection = Union[SimplexProjector, Callable[[Tensor], Tensor]]


# --------------------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------------------


def _first_bad(t: Tensor, bad: Tensor) -> str:
    pos = bad.nonzero()[0].tolist()
    return f"{t[tuple(pos)].item()} at index {tuple(pos) if len(pos) > 1 else pos[0]}"


def validate_plan_inputs(
    C: Tensor,
    mu: Tensor,
    nu: Tensor,
    atol: float = 1e-4,
    nu_total: Optional[float] = None,
    check_C: bool = True,
) -> None:
    """Raise ``ValueError`` naming the argument and the offending value/shape if the inputs are not usable.

    ``C`` must be 2-D (v, u) and finite; ``mu`` 1-D of length v, ``nu`` 1-D of length u, both finite and >= 0;
    ``sum(mu)`` and ``sum(nu)`` must be 1 within ``atol`` (at least 4 eps of their dtype; hence equal). ``nu_total``: the sum of the whole ``nu``
    when ``nu`` is only a column shard (checked instead of ``sum(nu)``).
    """
    if not isinstance(C, Tensor) or C.dim() != 2:
        raise ValueError(f"C must be a 2-D tensor (v x u), got shape {tuple(getattr(C, 'shape', ()))}")
    if not C.dtype.is_floating_point:
        raise ValueError(f"C must be a floating point tensor, got dtype {C.dtype}")
    v, u = C.shape
    for name, m, n in (("mu", mu, v), ("nu", nu, u)):
        if not isinstance(m, Tensor) or m.dim() != 1 or m.shape[0] != n:
            raise ValueError(
                f"{name} must be a 1-D tensor of length {n} to match C of shape {tuple(C.shape)}, "
                f"got shape {tuple(getattr(m, 'shape', ()))}")
        bad = ~torch.isfinite(m)
        if bool(bad.any()):
            raise ValueError(f"{name} must be finite, got {_first_bad(m, bad)}")
        neg = m < 0
        if bool(neg.any()):
            raise ValueError(f"{name} must be non-negative, got {_first_bad(m, neg)}")
    # low-precision marginals (e.g. a bfloat16 copy of a uniform mu) cannot sum to 1 more exactly than their eps
    atol = max(atol, 4 * torch.finfo(mu.dtype).eps, 4 * torch.finfo(nu.dtype).eps)
    smu = float(mu.double().sum())
    snu = float(nu.double().sum()) if nu_total is None else float(nu_total)
    if abs(smu - 1.0) > atol:
        raise ValueError(f"mu must sum to 1 (within {atol}), got sum(mu) = {smu!r}")
    if abs(snu - 1.0) > atol:
        raise ValueError(f"nu must sum to 1 (within {atol}), got sum(nu) = {snu!r}")
    if check_C and not bool(torch.isfinite(C.detach().sum())):  # one reduction; details only on failure
        bad = ~torch.isfinite(C.detach())
        if bool(bad.any()):
            raise ValueError(f"C must be finite (no NaN/inf), got {_first_bad(C.detach(), bad)}")


# --------------------------------------------------------------------------------------------------------------
# generic Dykstra (autograd through the given projections)
# --------------------------------------------------------------------------------------------------------------


def _sole_owner(t: Tensor) -> bool:
    """True when ``t`` is the only tensor on its storage (counted by the storage's reference count: ``t`` itself
    and the temporary storage object of this call). False when torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    return count(t.untyped_storage()._cdata) == 2


class Scratch:
    """Reused scratch buffers of the threshold Dykstra (the forward's two internal C-sized buffers, the backward's
    one), kept between calls. On CPU a fresh 100 MB buffer pays its page faults on first touch (~40 ms at
    50,304 x 512 against 5 ms to fill an existing one); CUDA's caching allocator reuses memory by itself. Costs two
    C-sized buffers of resident memory between calls, and (:meth:`fresh`) the storages of the last results and
    supports, which are handed out again only once nobody holds them: a result is never shared with a live one,
    and no content is carried from one use to the next (calls may interleave)."""

    def __init__(self):
        self._bufs = {}

    def get(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The contiguous buffer ``name`` of this shape, dtype and device (allocated when it has none such)."""
        b = self._bufs.get(name)
        if b is None or b.shape != tuple(shape) or b.dtype != dtype or b.device != device:
            b = self._bufs[name] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return b

    def fresh(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A tensor that nobody else holds, for a result or a saved support: the storage kept under ``name`` when
        every tensor handed out on it has been dropped (its storage's only owner is then this pool), else a new
        one, kept for next time. A caching allocator for these buffers: the CPU allocator returns every freed
        100 MB block to the OS, and the next call pays ~40 ms of page faults to get it back (4 copies of C at
        50,304 x 512). Handed out as a separate tensor on the storage (``set_``), not a view: autograd and the
        version counters see an ordinary tensor."""
        shape = tuple(shape)
        b = self._bufs.get(name)
        if b is None or b.shape != shape or b.dtype != dtype or b.device != device or not _sole_owner(b):
            b = self._bufs[name] = torch.empty(shape, dtype=dtype, device=device)
        with torch.no_grad():
            return torch.empty(0, dtype=dtype, device=device).set_(b.untyped_storage(), 0, shape, b.stride())

    @classmethod
    def reuse(cls, cur: Optional["Scratch"], device: torch.device) -> Optional["Scratch"]:
        """``cur`` (or a new one) on CPU, None elsewhere (see the class docstring)."""
        if device.type != "cpu":
            return None
        return cur if cur is not None else cls()


def dykstra(C: Tensor, row_proj: Projection, col_proj: Projection, n_iter: int = 3,
            scratch: Optional[Scratch] = None, drop_below: Optional[Tensor] = None) -> Tensor:
    """Algorithm 1: Dykstra's projections onto C1 (rows) and C2 (columns) with both correction terms.

    ::

        X_0 = C, P_0 = Q_0 = 0
        for k in range(n_iter):
            Y_k     = row_proj(X_k + P_k);   P_{k+1} = X_k + P_k - Y_k
            X_{k+1} = col_proj(Y_k + Q_k);   Q_{k+1} = Y_k + Q_k - X_{k+1}
        return X_{n_iter}

    ``row_proj`` / ``col_proj``: callables on the whole (v, u) matrix (differentiated by autograd), or
    :class:`~s2t2_dist.ot.simplex.SimplexProjector` objects for rows (scale per row) and columns (scale per
    column); when both are projectors the fused threshold implementation is used (same result, far less memory and
    time, gradients by the closed-form adjoint recursion). ``drop_below`` (projectors only; one value per column):
    entries of the result at or below it are set to 0, inside the same autograd Function (no extra C-sized
    temporaries); ``scratch``: reused buffers (see :class:`Scratch`).
    """
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    if isinstance(row_proj, SimplexProjector) and isinstance(col_proj, SimplexProjector):
        return _ThresholdDykstra.apply(C, row_proj, col_proj, int(n_iter), scratch, drop_below)
    if drop_below is not None:
        raise ValueError("dykstra: drop_below needs SimplexProjector projections")
    X, P, Q = C, None, None
    for _ in range(n_iter):
        A = X if P is None else X + P
        Y = row_proj(A)
        P = A - Y
        B = Y if Q is None else Y + Q
        X = col_proj(B)
        Q = B - X
    return X


# --------------------------------------------------------------------------------------------------------------
# fused threshold Dykstra
# --------------------------------------------------------------------------------------------------------------


def _as2d(shp3: Tuple[int, int, int]) -> Optional[Tuple[Tuple[int, int], int]]:
    """(2-D shape, slice dim) of a (O, n, I) view with O == 1 or I == 1 (the Sinkhorn's rows and columns)."""
    O, n, I = shp3
    if I == 1:
        return (O, n), 1
    if O == 1:
        return (n, I), 0
    return None


def _project_inplace(z: Tensor, shp3: Tuple[int, int, int], tau: Tensor, out: Optional[Tensor], sup: Support,
                     kernels: Optional[FusedKernels] = None) -> Tensor:
    """Output ``max(z - tau, 0)`` (into ``out`` when given); ``z`` becomes the correction ``z - output =
    min(z, tau)`` in place; ``sup.mask`` becomes ``z > tau`` (a new bool tensor). ``z`` is a contiguous buffer seen
    as ``shp3`` = (O, n, I), slices along dim 1."""
    O, n, I = shp3
    out = torch.empty_like(z) if out is None else out
    z3 = z.view(shp3)
    t = tau.view(O, 1, I)
    sup.mask = torch.gt(z3, t)
    two = _as2d(shp3)
    if kernels is not None and two is not None:
        kernels("project", z.view(two[0]), two[1], tau, out.view(two[0]))
        return out
    torch.sub(z3, t, out=out.view(shp3)).clamp_(min=0)
    z3.clamp_(max=t)
    return out


def _native(proj: SimplexProjector, dtype: torch.dtype, device: torch.device) -> Optional[NativeKernels]:
    """The projector's C kernels when they may run its projections whole: unsharded, cold (no warm start), not the
    functional ``exact`` mode, a CPU float32/float64 computation outside a dispatch mode."""
    k = proj.kernels
    if (isinstance(k, NativeKernels) and proj.comm.world_size == 1 and proj.n_total is None and not proj.warm_iters
            and not proj.exact and k.usable(torch.empty(0, dtype=dtype, device=device))):
        return k
    return None


def _count_unproven(proj: SimplexProjector, left: int) -> None:
    """Add ``left`` to ``proj.unproven`` (a tensor, as on the other paths)."""
    t = torch.tensor(left, dtype=torch.int64)
    proj.unproven = t if proj.unproven is None else proj.unproven + t


def _mask(scratch: Optional["Scratch"], slot: int, shape, device: torch.device) -> Tensor:
    """A support's bool mask: from ``scratch``'s pool (a tensor nobody else holds) when there is one."""
    if scratch is None:
        return torch.empty(shape, dtype=torch.bool, device=device)
    return scratch.fresh(f"mask{slot}", shape, torch.bool, device)


def _u8(mask: Tensor, shape) -> Tensor:
    """A bool mask's storage as 0/1 bytes of ``shape`` (what the C kernels write and read)."""
    return mask.view(shape).view(torch.uint8)


def _bwd_step(gin: Tensor, gcorr: Optional[Tensor], sup: Support, proj: SimplexProjector,
              shp3: Tuple[int, int, int], zero: bool = False) -> Tensor:
    """Adjoint of one projection + correction update: ``where(S, gin - m, gcorr)``, ``m = mean_S(gin - gcorr)``.

    ``gcorr`` None (a new buffer) or ``zero`` (``gcorr`` is only the output buffer) mean a zero correction. Writes
    into ``gcorr`` when given and returns it."""
    O, n, I = shp3
    zero = zero or gcorr is None
    two = _as2d(shp3)
    nk = _native(proj, gin.dtype, gin.device)
    if nk is not None and two is not None and two[1] == 0:  # a lone column projection (rows sharded)
        out = torch.empty_like(gin) if gcorr is None else gcorr
        nk.col_bwd(gin.view(two[0]), out.view(two[0]), _u8(sup.mask, two[0]), sup.counts, zero)
        return out
    kern = proj.kernels
    if kern is not None and two is not None:
        out = torch.empty_like(gin) if gcorr is None else gcorr
        (sh, rd), g2 = two, gin.view(two[0])
        m8 = sup.mask.view(sh).view(torch.uint8)  # (0/1 bytes: see fused.k_bwd_sums)
        if proj.comm.world_size == 1:  # unsharded: the sums and the update in one graph (no all-reduce between)
            kern("bwd", g2, out.view(sh), m8, sup.counts, rd, zero)
            return out
        sums = kern("bwd_sums", g2, None if zero else out.view(sh), m8, rd)
        m = proj.comm.all_reduce(sums, "sum") / sup.counts.clamp(min=1)
        kern("bwd_update", g2, out.view(sh), m8, m, rd, zero)
        return out
    g3 = gin.view(shp3)
    h = torch.where(sup.mask, g3 if zero else g3 - gcorr.view(shp3), 0)  # (where: a float * bool
    m = proj.comm.all_reduce(h.sum(1).reshape(-1), "sum") / sup.counts.clamp(min=1)  # product is ~20x slower)
    torch.sub(g3, m.view(O, 1, I), out=h)
    if gcorr is None:  # (h is the result)
        return torch.where(sup.mask, h, h.new_zeros(()), out=h).view(gin.shape)
    torch.where(sup.mask, h, h.new_zeros(()) if zero else gcorr.view(shp3), out=gcorr.view(shp3))
    return gcorr


def _forward(C: Tensor, row_proj: SimplexProjector, col_proj: SimplexProjector, n_iter: int,
             scratch: Optional[Scratch], cdt: torch.dtype) -> Tuple[Tensor, List[Support]]:
    """The iterations projection by projection (each projection's threshold search, then its output pass): the
    eager reference, the compiled passes, and the column-sharded solver (whose rows span ranks; its columns may take
    the C kernels). Returns the plan and the 2 * n_iter supports."""
    v, u = C.shape
    r3, c3 = (v, u, 1), (1, v, u)
    if scratch is not None:
        P = scratch.get("a", (v, u), cdt, C.device)
        P.copy_(C)  # A_0 = X_0 + P_0 = C
    else:
        P = C.to(cdt, copy=True).contiguous()
    Q: Optional[Tensor] = None
    X: Optional[Tensor] = None
    sups: List[Support] = []
    for it in range(n_iter):
        if X is not None:
            P.add_(X)
        # (the supports' masks are written by the projection passes, not by a pass of their own)
        # (slot: each projection starts from its own thresholds of the previous call)
        tau, sup = row_proj.threshold(P.view(r3), with_mask=False, slot=it)
        sups.append(sup)
        if Q is None:  # B_0 = Y_0 (Q_0 = 0)
            Q = _project_inplace(P, r3, tau, None if scratch is None else scratch.get("b", (v, u), cdt, C.device),
                                 sup, row_proj.kernels)
        else:
            X = _project_inplace(P, r3, tau, X, sup, row_proj.kernels)  # Y_k, in X's buffer (X_k is in P now)
            Q.add_(X)
        if X is None and scratch is not None:  # (the result: a tensor nobody else holds)
            X = scratch.fresh("out", (v, u), cdt, C.device)
        nk = _native(col_proj, cdt, C.device)
        if nk is not None:
            X = torch.empty_like(Q) if X is None else X
            sup = Support("mask", Q.new_empty(u), _mask(scratch, 2 * it + 1, c3, C.device))
            _count_unproven(col_proj, nk.col_step(Q, X, _u8(sup.mask, (v, u)),
                                                  col_proj.scale.to(torch.float64).contiguous(), sup.counts))
            sups.append(sup)
            continue
        tau, sup = col_proj.threshold(Q.view(c3), with_mask=False, slot=it)
        sups.append(sup)
        X = _project_inplace(Q, c3, tau, X, sup, col_proj.kernels)
    return X, sups


def _native_forward(nk: NativeKernels, C: Tensor, row_proj: SimplexProjector, col_proj: SimplexProjector,
                    n_iter: int, scratch: Optional[Scratch], cdt: torch.dtype) -> Tuple[Tensor, List[Support]]:
    """All the iterations by the C kernels (:meth:`~s2t2_dist.ot.native.NativeKernels.dykstra_fwd`); the same
    plan and supports as :func:`_forward`."""
    v, u = C.shape
    src = C if C.dtype == cdt and C.is_contiguous() else C.to(cdt).contiguous()
    if scratch is not None:
        P, Q = scratch.get("a", (v, u), cdt, C.device), scratch.get("b", (v, u), cdt, C.device)
        X = scratch.fresh("out", (v, u), cdt, C.device)
    else:
        P, Q, X = (torch.empty((v, u), dtype=cdt, device=C.device) for _ in range(3))
    masks = [_mask(scratch, k, (v, u, 1) if k % 2 == 0 else (1, v, u), C.device) for k in range(2 * n_iter)]
    counts_r = torch.empty((n_iter, v), dtype=cdt, device=C.device)
    counts_c = torch.empty((n_iter, u), dtype=cdt, device=C.device)
    left_r, left_c = nk.dykstra_fwd(src, P, Q, X, [_u8(m, (v, u)) for m in masks],
                                    row_proj.scale.to(torch.float64).contiguous(),
                                    col_proj.scale.to(torch.float64).contiguous(), counts_r, counts_c)
    _count_unproven(row_proj, left_r)
    _count_unproven(col_proj, left_c)
    sups = [Support("mask", (counts_r if k % 2 == 0 else counts_c)[k // 2], m) for k, m in enumerate(masks)]
    return X, sups


class _ThresholdDykstra(torch.autograd.Function):
    """Dykstra with simplex projections, forward in place on three (v, u) buffers, backward in closed form.

    Forward buffers: ``P`` (holds A_k = X_k + P_k, then P_{k+1} = min(A_k, tau_row)), ``Q`` (B_k, then Q_{k+1}),
    and the projected iterate. Saved for backward: only the 2 * n_iter supports (bool masks) and per-slice counts.
    No host reads: the graph and every shape are the same whatever the data.

    Backward (adjoint of ``A = X + P; Y = R(A); P' = A - Y; B = Y + Q; X' = K(B); Q' = B - X'``, with R, K the
    symmetric Jacobians ``J h = S * (h - mean_S h)``)::

        gB = where(S_K, gX' - mean_S_K(gX' - gQ'), gQ');  gQ = gY = gB
        gA = where(S_R, gB  - mean_S_R(gB  - gP'), gP');  gP = gX = gA
    starting from gX = grad_output, gP = gQ = 0; the gradient of C is gA of the first iteration.

    With the C kernels (:class:`~s2t2_dist.ot.native.NativeKernels`, both projections unsharded, CPU) the forward
    and this recursion run whole in C on the same buffers, saving the same supports; otherwise projection by
    projection (:func:`_forward`, :func:`_bwd_step`).
    """

    @staticmethod
    def forward(ctx, C: Tensor, row_proj: SimplexProjector, col_proj: SimplexProjector, n_iter: int,
                scratch: Optional[Scratch] = None, drop_below: Optional[Tensor] = None):
        cdt = compute_dtype(C.dtype)
        v, u = C.shape
        nk = _native(row_proj, cdt, C.device)
        ctx.native = nk is not None and _native(col_proj, cdt, C.device) is nk
        if ctx.native:  # the whole Dykstra in C
            X, sups = _native_forward(nk, C.detach(), row_proj, col_proj, n_iter, scratch, cdt)
        else:
            X, sups = _forward(C.detach(), row_proj, col_proj, n_iter, scratch, cdt)
        keep = None
        if drop_below is not None:  # (in place: X is this call's own buffer)
            keep = X > drop_below.to(device=X.device, dtype=X.dtype).view(1, u)
            torch.where(keep, X, X.new_zeros(()), out=X)
        ctx.kinds = [s.kind for s in sups]
        ctx.row_proj, ctx.col_proj, ctx.scratch = row_proj, col_proj, scratch
        ctx.shape = (v, u)
        ctx.in_dtype = C.dtype
        flat = []
        for s in sups:
            flat += s.tensors()
        ctx.has_keep = keep is not None
        ctx.save_for_backward(*flat, *([keep] if keep is not None else []))
        # (kind, nnz as a 0-d tensor) per projection: int() them on logging steps only (host reads)
        ctx.stats = [(s.kind, s.nnz()) for s in sups]
        return X.to(C.dtype)  # (X itself when C is in the compute dtype: not a view, so callers may work in place)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        saved = ctx.saved_tensors
        sups = [Support(kind, *saved[2 * i: 2 * i + 2]) for i, kind in enumerate(ctx.kinds)]
        v, u = ctx.shape
        cdt = sups[0].counts.dtype
        gX = g.to(cdt).contiguous()
        if ctx.has_keep:  # the dropped entries pass no gradient
            buf = None if ctx.scratch is None else ctx.scratch.get("b", (v, u), cdt, gX.device)
            gX = torch.where(saved[-1], gX, gX.new_zeros(()), out=buf)
        gP: Optional[Tensor] = None
        gQ: Optional[Tensor] = None
        if ctx.scratch is not None:  # gQ's buffer, and gP's (the result: a tensor nobody else holds)
            gQ = ctx.scratch.get("a", (v, u), cdt, gX.device)
            gP = ctx.scratch.fresh("grad", (v, u), cdt, gX.device)
        nk = _native(ctx.row_proj, cdt, gX.device) if ctx.native else None
        if nk is not None:  # (under a dispatch mode the reference ops below run on the same supports)
            gQ = torch.empty_like(gX) if gQ is None else gQ
            gP = torch.empty_like(gX) if gP is None else gP
            nk.dykstra_bwd(gX, gQ, gP, [_u8(s.mask, (v, u)) for s in sups], torch.stack([s.counts for s in sups[::2]]),
                           torch.stack([s.counts for s in sups[1::2]]))
            return gP.to(ctx.in_dtype), None, None, None, None, None
        last = len(sups) // 2 - 1
        for it in reversed(range(len(sups) // 2)):
            gQ = _bwd_step(gX, gQ, sups[2 * it + 1], ctx.col_proj, (1, v, u), zero=it == last)
            gP = _bwd_step(gQ, gP, sups[2 * it], ctx.row_proj, (v, u, 1), zero=it == last)
            gX = gP
        return gP.to(ctx.in_dtype), None, None, None, None, None


# --------------------------------------------------------------------------------------------------------------
# public plans
# --------------------------------------------------------------------------------------------------------------


def set_kernels(projs, fused, C: Tensor) -> None:
    """Give the projectors the pass kernels ``fused`` asks for (see :func:`~s2t2_dist.ot.native.resolve_fused`),
    decided per call from C's device and size (the same kernels object while that decision holds)."""
    k = resolve_fused(fused, C.device, C.numel())
    cur = projs[0].kernels
    if k is not None and cur is not None and type(cur) is type(k) and cur.compiled == k.compiled:
        k = cur  # keep the call counter
    for p in projs:
        p.kernels = k


class SparseSinkhorn:
    """Sparse Sinkhorn with persistent projectors: call it every training step for warm starts.

    ``P = SparseSinkhorn(mu, nu)(C, n_iter)``. No host reads after the first call's validation; :meth:`unproven`
    (read it on logging steps) counts the slices whose threshold the fixed iterations left a lower bound (0 unless
    a pathological C defeats them). ``fused``: True / False / ``"auto"`` (default: compiled pass kernels on CPU for
    large C, see :mod:`s2t2_dist.ot.fused`; the eager ops are the reference and give the same supports).
    """

    def __init__(self, mu: Tensor, nu: Tensor, row_k: int = DEFAULT_ROW_K, col_k: int = DEFAULT_COL_K,
                 validate: bool = True, fused: Union[bool, str] = "auto"):
        self.mu, self.nu = mu, nu
        self.validate = validate
        self.fused = fused
        cdt = compute_dtype(mu.dtype) if mu.dtype.is_floating_point else torch.float32
        # (cold starts: the projectors' warm_iters stays 0, see simplex.DEFAULT_WARM_ITERS)
        self.rows = SimplexProjector(mu.detach().to(cdt), k=row_k)
        self.cols = SimplexProjector(nu.detach().to(cdt), k=col_k)
        self.scratch: Optional[Scratch] = None

    def __call__(self, C: Tensor, n_iter: int = 3, drop_below: Optional[Tensor] = None) -> Tensor:
        if self.validate:
            # Once: mu and nu are fixed, and each check is a host sync (a GPU stall) that every training step
            # would pay. A C that turns non-finite later makes the loss non-finite, which the loop's bad-step
            # check catches.
            validate_plan_inputs(C, self.mu, self.nu)
            self.validate = False
        cdt = compute_dtype(C.dtype)
        for p, m in ((self.rows, self.mu), (self.cols, self.nu)):
            if p.scale.dtype != cdt or p.scale.device != C.device:
                p.scale = m.detach().to(device=C.device, dtype=cdt)
        set_kernels((self.rows, self.cols), self.fused, C)
        self.scratch = Scratch.reuse(self.scratch, C.device)
        return dykstra(C, self.rows, self.cols, n_iter, self.scratch, drop_below)

    def unproven(self) -> Optional[Tensor]:
        """Slices (rows and columns, all calls so far) whose threshold was not proven exact: a device tensor."""
        parts = [p.unproven for p in (self.rows, self.cols) if p.unproven is not None]
        return sum(parts) if parts else None


def sparse_sinkhorn(
    C: Tensor,
    mu: Tensor,
    nu: Tensor,
    n_iter: int = 3,
    *,
    row_k: int = DEFAULT_ROW_K,
    col_k: int = DEFAULT_COL_K,
    validate: bool = True,
    implementation: str = "fused",
    fused: Union[bool, str] = "auto",
) -> Tensor:
    """Sparse Sinkhorn (Algorithm 1 with scaled sparsemax): ``P`` (v, u) with rows ~ ``mu``, columns = ``nu``.

    Differentiable in ``C`` (``mu`` and ``nu`` are constants). After the last (column) projection the column sums
    are exact; the row sums converge as ``n_iter`` grows. ``implementation``: ``"fused"`` (default; in-place
    buffers, closed-form backward) or ``"autograd"`` (generic :func:`dykstra` with :func:`sparsemax` callables; for
    checking). ``row_k`` / ``col_k``: threshold candidates per row / column (speed only). ``fused``: compiled pass
    kernels for ``implementation="fused"`` (see :class:`SparseSinkhorn`).
    """
    if validate:
        validate_plan_inputs(C, mu, nu)
    cdt = compute_dtype(C.dtype)
    mu_c = mu.detach().to(device=C.device, dtype=cdt)
    nu_c = nu.detach().to(device=C.device, dtype=cdt)
    if implementation == "fused":
        return SparseSinkhorn(mu_c, nu_c, row_k, col_k, validate=False, fused=fused)(C, n_iter)
    if implementation == "autograd":
        return dykstra(
            C,
            lambda Z: sparsemax(Z, mu_c.to(Z.dtype).unsqueeze(1), dim=1, k=row_k),
            lambda Z: sparsemax(Z, nu_c.to(Z.dtype).unsqueeze(0), dim=0, k=col_k),
            n_iter,
        )
    raise ValueError(f"implementation must be 'fused' or 'autograd', got {implementation!r}")


def softmax_sinkhorn(C: Tensor, mu: Tensor, nu: Tensor, n_iter: int = 3, *, validate: bool = True) -> Tensor:
    """The paper's dense baseline: scaled softmax in place of sparsemax, ``P`` (v, u) with columns exactly ``nu``.

    Softmax is the KL (Bregman) projection onto a scaled simplex, as sparsemax is the Euclidean one. For KL
    projections onto the affine sets C1, C2 Dykstra's correction terms vanish and Algorithm 1 becomes the classic
    Sinkhorn scaling of ``K = exp(C)``: ``Z <- log mu_i + log_softmax(Z_i.)``, then ``Z <- log nu_j +
    log_softmax(Z_.j)``, ``P = exp(Z)``. (Plugging softmax literally into the Euclidean correction terms of
    :func:`dykstra` is wrong: the column step then sees ``Y + Q``, which no longer contains ``C``, and the plan is
    ~``mu nu^T`` whatever ``C`` is -- the translator cannot learn.) Every entry is positive; the rows converge to
    ``mu`` as ``n_iter`` grows. ``C = log P`` reproduces a feasible, positive ``P`` exactly. Autograd throughout.
    """
    if validate:
        validate_plan_inputs(C, mu, nu)
    return log_sinkhorn(C, mu, nu, n_iter, lambda Z: torch.log_softmax(Z, 1))


def log_sinkhorn(C: Tensor, mu: Tensor, nu: Tensor, n_iter: int, row_log_softmax: Callable[[Tensor], Tensor]
                 ) -> Tensor:
    """Sinkhorn scaling of ``exp(C)`` in the log domain, generic in the row log-softmax (the sharded translator's
    rows span ranks); the column step is always local. Zero marginals are floored at the dtype's smallest normal
    number (their rows / columns come out ~0, not NaN)."""
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    tiny = torch.finfo(C.dtype).tiny
    log_mu = mu.detach().to(device=C.device, dtype=C.dtype).clamp_min(tiny).log().unsqueeze(1)
    log_nu = nu.detach().to(device=C.device, dtype=C.dtype).clamp_min(tiny).log().unsqueeze(0)
    Z = C
    for _ in range(n_iter):
        Z = log_mu + row_log_softmax(Z)
        Z = log_nu + torch.log_softmax(Z, 0)
    return Z.exp()


def unconstrained_plan(C: Tensor, nu: Tensor) -> Tensor:
    """The unconstrained baseline ``P = C * nu[None, :]``: its normalised weights ``P / nu`` are ``C`` itself
    (convex combinations only while the columns of ``C`` stay on the simplex, e.g. at the init ``C = 1/v``)."""
    if nu.dim() != 1 or nu.shape[0] != C.shape[-1]:
        raise ValueError(f"nu must be a 1-D tensor of length {C.shape[-1]}, got shape {tuple(nu.shape)}")
    return C * nu.to(device=C.device, dtype=C.dtype).unsqueeze(0)
