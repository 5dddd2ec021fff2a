"""Fused (``torch.compile``, inductor) kernels for the passes of the sync-free sparse Sinkhorn.

Pure math: no torch.distributed, no I/O. Each kernel is a plain torch function (the eager REFERENCE, used
whenever compilation is off or impossible) compiled with ``fullgraph=True``: a host read (``.item()``,
``nonzero``) would break the graph and fail the compile, so a compiled kernel cannot hide a sync.

Why: on CPU an eager pass ``count and sum of z - t above t`` costs 3-5 full-matrix ops, each writing a fresh
C-sized temporary (page faults on every allocation), ~0.5 s at 50,304 x 512; the same pass compiled is one loop
that reads z once and writes nothing but the per-slice results, ~10 ms (``bench/bench_sinkhorn.py``). Outputs that
are C-sized are written into buffers the caller owns (in place), never freshly allocated.

Every kernel works on a 2-D ``(n, I)`` / ``(O, n)`` matrix ``z2`` whose slices run along ``rd`` (1: rows, contiguous;
0: columns). Column reductions are split into blocks of ``_COL_BLOCK`` rows (an inner reduction, then a sum over
blocks): inductor's CPU code for a plain ``sum(0)`` over 50,304 rows was ~25x slower than the split one, and
blocks of 16 rows (the 16-float vector width) ~2x faster than 48 (a pass over 50,304 x 512: 8.5 vs 18 ms).

Under a ``TorchDispatchMode`` (the host-sync counter of ``s2t2_dist.utils.syncs``) torch.compile cannot run; the
eager reference runs instead, so the counter sees exactly the ops the compiled graph was traced from.
"""
from __future__ import annotations

import functools
import shutil
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["FusedKernels", "fused_available", "FUSED_MIN_NUMEL"]

_COL_BLOCK = 16
# "auto" compiles only for matrices at least this large: compiling costs seconds per shape, and small problems
# (tests, the demo, v = 243) are cheap eagerly
FUSED_MIN_NUMEL = 1 << 22


def _reduce(x: Tensor, rd: int, op: str) -> Tensor:
    """``op`` ("sum", "amax" or "amin") along ``rd`` of a 2-D tensor (columns: split into row blocks, see the module
    docstring)."""
    red = getattr(Tensor, op)
    if rd == 1:
        return red(x, 1)
    n = x.shape[0]
    nb = n // _COL_BLOCK
    if nb < 2:
        return red(x, 0)
    m = nb * _COL_BLOCK
    s = red(red(x[:m].view(nb, _COL_BLOCK, x.shape[1]), 1), 0)
    if m == n:
        return s
    rest = red(x[m:], 0)
    return {"sum": torch.add, "amax": torch.maximum, "amin": torch.minimum}[op](s, rest)


def _rsum(x: Tensor, rd: int) -> Tensor:
    return _reduce(x, rd, "sum")


def _ramax(x: Tensor, rd: int) -> Tensor:
    return _reduce(x, rd, "amax")


def _bc(t: Tensor, rd: int) -> Tensor:
    """A per-slice vector broadcast against the 2-D matrix."""
    return t.unsqueeze(rd)


# ------------------------------------------------------------------ the kernels (eager references)
def k_bounds(z: Tensor, rd: int) -> Tuple[Tensor, Tensor]:
    """(sum, max) of every slice."""
    return _rsum(z, rd), _ramax(z, rd)


def k_newton(z: Tensor, rd: int, t: Tensor) -> Tuple[Tensor, Tensor]:
    """(sum of z - t over z > t, count of z > t) per slice, in z's dtype (counts exact below 2**24 in float32)."""
    tb = _bc(t, rd)
    return _rsum((z - tb).clamp_min(0), rd), _rsum((z > tb).to(z.dtype), rd)


def lower_bound(sums: Tensor, cand: Tensor, scale: Tensor, n_total: int) -> Tensor:
    """max((sum z - s) / n, cand) per slice, float64: two lower bounds of the threshold (``cand``: the threshold of
    a few top elements, e.g. ``max z - s`` for the top one)."""
    return torch.maximum((sums.double() - scale) / n_total, cand)


def newton_step(tau: Tensor, t: Tensor, dsum: Tensor, cnt: Tensor, scale: Tensor) -> Tensor:
    """One Newton (Michelot) step from ``t`` (``tau`` in the compute dtype), float64: ``t + (sum_S (z - t) - s) /
    |S|``, which equals ``(sum_S z - s) / |S|`` but keeps its precision when the values are large and close. From
    any point it lands at or below the root (f is convex), from a lower bound it never falls. An empty support
    (scale 0: tau = max z) keeps ``tau``."""
    cnt = cnt.double()
    return torch.where(cnt > 0, t.double() + (dsum.double() - scale) / cnt.clamp(min=1), tau)


def k_warm(z: Tensor, rd: int, t: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The warm start's pass: (sum of z - t over z > t, count of z > t, sum z, max z) per slice."""
    dsum, cnt = k_newton(z, rd, t)
    sums, mx = k_bounds(z, rd)
    return dsum, cnt, sums, mx


def warm_bound(t: Tensor, dsum: Tensor, cnt: Tensor, sums: Tensor, mx: Tensor, scale: Tensor,
               n_total: int) -> Tensor:
    """A lower bound of the threshold from a pass at ANY point ``t`` (e.g. the previous step's threshold), float64:
    the Newton step from ``t`` (at or below the root, f being convex), and at least the cold start's bound
    (:func:`lower_bound`; also when ``t`` is above every element: no support, no step)."""
    lb = lower_bound(sums, mx.double() - scale, scale, n_total)
    return torch.maximum(newton_step(lb, t, dsum, cnt, scale), lb)


def _newton_chain(z: Tensor, rd: int, tau: Tensor, scale: Tensor, iters: int) -> Tuple[Tensor, Tensor, Tensor]:
    prev = changed = None
    for _ in range(iters):
        t = tau.to(z.dtype)
        dsum, cnt = k_newton(z, rd, t)
        cnt = cnt.double()  # (as the sharded passes return it)
        tau = newton_step(tau, t, dsum, cnt, scale)
        changed, prev = (None if prev is None else cnt != prev), cnt
    return tau, prev, changed


def k_chain(z: Tensor, rd: int, scale: Tensor, n_total: int, iters: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The whole threshold search of an unsharded projection in one graph: the starting bound and ``iters`` Newton
    steps. Returns (tau float64, support counts, not proven) per slice (see ``SimplexProjector._newton``).
    Compiled, the row version is ONE loop over the rows whose passes re-read the row from L1 (softmax-like), not
    ``iters + 1`` passes over memory."""
    sums, mx = k_bounds(z, rd)
    return _newton_chain(z, rd, lower_bound(sums, mx.double() - scale, scale, n_total), scale, iters)


def k_chain_warm(z: Tensor, rd: int, scale: Tensor, n_total: int, warm: Tensor, iters: int
                 ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`k_chain` started from a warm point (float64 thresholds of a previous call): its pass gives the
    starting lower bound (:func:`warm_bound`), then ``iters`` Newton steps."""
    t = warm.to(z.dtype)
    return _newton_chain(z, rd, warm_bound(t, *k_warm(z, rd, t), scale, n_total), scale, iters)


def k_project(z: Tensor, rd: int, t: Tensor, out: Tensor) -> None:
    """``out = max(z - t, 0)``; ``z = min(z, t)`` (the Dykstra correction ``z - out``), both in place. (The support
    mask ``z > t`` is an eager op of the caller: inductor's CPU code stores bools one at a time, 172 ms against
    11.5 ms for ``torch.gt(..., out=)`` at 50,304 x 512.)"""
    tb = _bc(t, rd)
    out.copy_((z - tb).clamp_min(0))
    z.copy_(torch.minimum(z, tb))


def k_bwd_sums(g: Tensor, gc: Optional[Tensor], mask: Tensor, rd: int) -> Tensor:
    """Per-slice sums over the support of ``g - gc`` (``gc`` None: of ``g``). ``mask``: the support as uint8 0/1
    (a bool mask's ``.view(torch.uint8)``): inductor's CPU code loads bools one at a time (a row backward took
    39 ms with a bool mask and ``where``, 12.7 ms with uint8 and products, at 50,304 x 512)."""
    h = g if gc is None else g - gc
    return _rsum(h * mask, rd)


def k_bwd_update(g: Tensor, gc: Tensor, mask: Tensor, m: Tensor, rd: int, zero: bool) -> None:
    """``gc = where(mask, g - m, gc)`` in place (``zero``: ``where(mask, g - m, 0)``), as products with the 0/1
    ``mask`` (exact: ``1 * x + 0 * y = x`` for finite values)."""
    new = (g - _bc(m, rd)) * mask
    gc.copy_(new if zero else new + gc * (1 - mask))


def k_bwd(g: Tensor, gc: Tensor, mask: Tensor, counts: Tensor, rd: int, zero: bool) -> None:
    """Both backward kernels of an unsharded projection in one graph: ``gc = where(mask, g - m, gc)`` in place,
    ``m`` the mean of ``g - gc`` over the support (``zero``: ``gc`` counts as 0 and is only the output buffer).
    (Rows: one pass, softmax-like.)"""
    m = k_bwd_sums(g, None if zero else gc, mask, rd) / counts.clamp(min=1)
    k_bwd_update(g, gc, mask, m, rd, zero)


# ------------------------------------------------------------------ the sparse kind's weight floor (translator/floor.py)
def k_floor_keep(P: Tensor, thr: Tensor) -> Tuple[Tensor, Tensor]:
    """``P = where(P >= thr, P, 0)`` in place (a threshold per column); returns the kept column sums and minima."""
    P.copy_(torch.where(P >= thr.unsqueeze(0), P, 0.0))
    return _rsum(P, 0), _reduce(P, 0, "amin")


def k_col_argmax(z: Tensor) -> Tensor:
    """Per column, the index of its first largest entry (as ``argmax(0)``; ``max(0)`` is ~6x slower on CPU), in
    z's dtype (exact below 2**24 rows in float32)."""
    mx = _ramax(z, 0)
    rows = torch.arange(z.shape[0], dtype=z.dtype, device=z.device).unsqueeze(1)
    return _reduce(torch.where(z == mx, rows, float("inf")), 0, "amin")


def k_floor_bwd(g: Tensor, out: Tensor, a: Tensor, s_inv: Tensor) -> Tensor:
    """``where(out > 0, a g - (sum_i g out) s_inv, 0)`` per column (the floor's closed-form backward)."""
    dot = _rsum(g * out, 0)
    return torch.where(out > 0, g * a - (dot * s_inv).unsqueeze(0), 0.0)


_EAGER = {"bounds": k_bounds, "newton": k_newton, "chain": k_chain, "warm": k_warm, "chain_warm": k_chain_warm,
          "project": k_project, "bwd_sums": k_bwd_sums,
          "bwd_update": k_bwd_update, "bwd": k_bwd, "floor_keep": k_floor_keep, "col_argmax": k_col_argmax,
          "floor_bwd": k_floor_bwd}


@functools.lru_cache(maxsize=None)
def fused_available() -> bool:
    """True when inductor can build CPU kernels here (a C++ compiler on PATH)."""
    try:
        import torch._inductor  # noqa: F401 - availability check

        from torch._inductor import config as ic
    except ImportError:  # pragma: no cover - torch without inductor
        return False
    cxx = getattr(ic.cpp, "cxx", (None, "g++"))
    names = [c for c in (cxx if isinstance(cxx, (tuple, list)) else (cxx,)) if c]
    return any(shutil.which(c) for c in names) or bool(shutil.which("g++"))


# graphs per kernel: one per (shape, slice dim, dtype); dynamo's default of 8 is an error under fullgraph=True once a
# process (tests, benchmarks, a stage with several plan shapes) has solved more shapes than that
_RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    # fullgraph: a graph break (e.g. a host read) is an error, not a silent eager fallback; dynamic=False: one
    # specialised kernel per shape (training calls one shape)
    import torch._dynamo.config as dcfg

    dcfg.recompile_limit = max(dcfg.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(_EAGER[name], fullgraph=True, dynamic=False)


class FusedKernels:
    """The kernels above, compiled (``compiled=True``) or eager; counts the compiled calls (for tests)."""

    def __init__(self, compiled: bool = True):
        self.compiled = bool(compiled)
        self.calls = 0

    def __call__(self, name: str, *args):
        if self.compiled and _get_current_dispatch_mode() is None:
            self.calls += 1
            return _compiled(name)(*args)
        return _EAGER[name](*args)
