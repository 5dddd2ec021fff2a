"""Hand-written CPU kernels for the threshold Dykstra (``csrc/dykstra_cpu*``): the unsharded Sinkhorn whole.

Pure math: no torch.distributed, no data I/O. The eager passes (``simplex.py``) stay
the reference; these kernels compute the same projections (the same lower bounds, the same Newton steps, supports
proven the same way, sums in another order) with far fewer passes over memory, which is what bounds them on CPU:

* every slice stops as soon as its support count repeats (the proof of exactness the fixed passes also use),
  where the compiled path runs a fixed 7 passes per projection;
* a row is searched and projected while it sits in L1, in the same pass that finishes the previous column
  projection (its output X is never written: it is only the next row projection's input) and gathers the next
  column projection's starting bounds;
* the columns' Newton passes stream whole rows with every column's state in L1;
* the backward is one column-sums pass, then one pass per iteration (the column update, the row's mean and update
  in L1, and the next column sums).

At 50,304 x 512 that is ~22 C-sized transfers forward and ~17 backward, against ~60 for the per-pass kernels.

CPU only, so nothing here can stall a GPU. The C file is built on first use (``cbuild.py``: the system's C
compiler, a cache keyed on source, compiler and CPU); without a compiler, after a failed build, or with
``S2T2_NATIVE=0``, :func:`library` is None and the solver uses the compiled (inductor) passes instead.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import cbuild
from .fused import FUSED_MIN_NUMEL, FusedKernels, fused_available

__all__ = ["NativeKernels", "library", "native_available", "resolve_fused", "MAX_PASSES"]

#: Newton passes per slice at most: the shapes here prove every slice in 2-5; a slice still unproven after this many
#: (a lattice of ties) keeps its lower bound and is counted in ``SimplexProjector.unproven``, as on the fixed path
MAX_PASSES = 32


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    for sfx in ("f32", "f64"):
        f = getattr(lib, f"s2t2_dykstra_fwd_{sfx}")
        f.argtypes, f.restype = [p, p, p, p, p, p, p, i64, i64, i32, p, p, p, i32, i32], i32
        f = getattr(lib, f"s2t2_dykstra_bwd_{sfx}")
        f.argtypes, f.restype = [p, p, p, p, p, p, i64, i64, i32, i32], i32
        f = getattr(lib, f"s2t2_col_step_{sfx}")
        f.argtypes, f.restype = [p, p, p, p, i64, i64, p, i32, i32], i64
        f = getattr(lib, f"s2t2_col_bwd_{sfx}")
        f.argtypes, f.restype = [p, p, p, p, i64, i64, i32, i32], i32
    return lib


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels (built on first use, see the module docstring), or None when unavailable."""
    lib = cbuild.load("dykstra_cpu.c", ["dykstra_cpu_impl.h", "parallel.h"],
                      "the sparse Sinkhorn uses the compiled inductor passes instead")
    return None if lib is None else _declare(lib)


def native_available() -> bool:
    """True when the kernels are built (or can be) here."""
    return library() is not None


def _ptr(t: Optional[Tensor]):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


_SFX = {torch.float32: "f32", torch.float64: "f64"}


def _ptrs(ts) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


class NativeKernels(FusedKernels):
    """The C kernels: the whole unsharded Dykstra (:meth:`dykstra_fwd`, :meth:`dykstra_bwd`) and a lone column
    projection (:meth:`col_step`, :meth:`col_bwd`: the column-sharded solver's, whose rows span ranks), plus the
    compiled passes (:class:`FusedKernels`) for everything else. ``usable`` says when they may run: CPU tensors of
    float32/float64, outside a ``TorchDispatchMode`` (under the host-sync counter the solver runs the reference
    ops, which are what it counts)."""

    def __init__(self):
        super().__init__(compiled=fused_available())
        self.lib = library()
        self.native_calls = 0

    def usable(self, t: Tensor) -> bool:
        return (self.lib is not None and t.device.type == "cpu" and t.dtype in _SFX
                and _get_current_dispatch_mode() is None)

    def _fn(self, name: str, t: Tensor):
        self.native_calls += 1
        return getattr(self.lib, f"s2t2_{name}_{_SFX[t.dtype]}")

    @staticmethod
    def _check(dtype: torch.dtype, *ts: Optional[Tensor]) -> None:
        for t in ts:
            if t is not None and (not t.is_contiguous() or t.device.type != "cpu"
                                  or t.dtype not in (dtype, torch.uint8, torch.float64)):
                raise ValueError(f"native kernels need contiguous CPU tensors, got {t.dtype} {tuple(t.shape)} "
                                 f"strides {t.stride()}")

    def dykstra_fwd(self, C: Tensor, P: Tensor, Q: Tensor, X: Tensor, masks, mu: Tensor, nu: Tensor,
                    counts_r: Tensor, counts_c: Tensor) -> Tuple[int, int]:
        """All ``len(masks) // 2`` iterations: ``X`` the plan, ``masks`` (bool (v, u) each) the supports, row
        projection of iteration k at 2k and column at 2k + 1; ``counts_r`` (n, v) and ``counts_c`` (n, u) their
        sizes; P and Q working buffers; ``mu``, ``nu`` float64. Returns the (rows, columns) left unproven."""
        self._check(C.dtype, C, P, Q, X, mu, nu, counts_r, counts_c, *masks)
        v, u = C.shape
        n = len(masks) // 2
        left = (ctypes.c_int64 * 2)()
        rc = self._fn("dykstra_fwd", C)(_ptr(C), _ptr(P), _ptr(Q), _ptr(X), _ptrs(masks), _ptr(mu), _ptr(nu), v, u,
                                        n, _ptr(counts_r), _ptr(counts_c), left, MAX_PASSES,
                                        torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native dykstra_fwd: out of memory")
        return int(left[0]), int(left[1])

    def dykstra_bwd(self, g: Tensor, gQ: Tensor, gP: Tensor, masks, counts_r: Tensor, counts_c: Tensor) -> None:
        """The gradient of C into ``gP`` from the upstream ``g`` (read only); ``gQ`` a working buffer."""
        self._check(g.dtype, g, gQ, gP, counts_r, counts_c, *masks)
        v, u = g.shape
        rc = self._fn("dykstra_bwd", g)(_ptr(g), _ptr(gQ), _ptr(gP), _ptrs(masks), _ptr(counts_r), _ptr(counts_c),
                                        v, u, len(masks) // 2, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native dykstra_bwd: out of memory")

    def col_step(self, Z: Tensor, out: Tensor, mask: Tensor, scale: Tensor, counts: Tensor) -> int:
        """Per column the exact threshold t of Z; ``out`` = max(Z - t, 0), Z = min(Z, t), ``mask`` = Z > t,
        ``counts`` per column. Returns the columns left unproven."""
        self._check(Z.dtype, Z, out, mask, scale, counts)
        v, u = Z.shape
        left = int(self._fn("col_step", Z)(_ptr(Z), _ptr(out), _ptr(mask), _ptr(scale), v, u, _ptr(counts),
                                           MAX_PASSES, torch.get_num_threads()))
        if left < 0:
            raise MemoryError("native col_step: out of memory")
        return left

    def col_bwd(self, g: Tensor, gc: Tensor, mask: Tensor, counts: Tensor, zero: bool) -> None:
        """``gc = where(mask, g - m, gc)`` in place (``zero``: ``where(mask, g - m, 0)``), ``m`` the mean of ``g -
        gc`` (``zero``: of ``g``) over each column's support."""
        self._check(g.dtype, g, gc, mask, counts)
        v, u = g.shape
        if self._fn("col_bwd", g)(_ptr(g), _ptr(gc), _ptr(mask), _ptr(counts), v, u, int(zero),
                                  torch.get_num_threads()) != 0:
            raise MemoryError("native col_bwd: out of memory")


def resolve_fused(fused, device: torch.device, numel: int) -> Optional[FusedKernels]:
    """The solver's kernels for ``fused``: True (compiled passes; eager if no compiler), False (the eager ops, no
    kernels), "native" (:class:`NativeKernels`: the C kernels where they apply, the compiled passes elsewhere),
    "auto" (on CPU, for matrices of at least ``fused.FUSED_MIN_NUMEL`` entries: "native" where the C kernels build,
    else True; otherwise False), or a :class:`FusedKernels` as it is. (Here, not in ``fused.py``: it picks between
    the two modules' kernels.)"""
    if isinstance(fused, FusedKernels):
        return fused
    if fused == "auto":
        fused = device.type == "cpu" and numel >= FUSED_MIN_NUMEL
        if fused:
            fused = "native" if native_available() else True
    elif not isinstance(fused, bool) and fused != "native":
        raise ValueError(f"fused must be True, False, 'native' or 'auto', got {fused!r}")
    if not fused:
        return None
    if fused == "native":
        return NativeKernels()
    return FusedKernels(compiled=fused_available())
