"""Hand-written CPU kernels for the threshold Dykstra (``csrc/dykstra_cpu*``): the unsharded Sinkhorn whole.

Pure math plus the build of one C file: no torch.distributed, no data I/O. The eager passes (``simplex.py``) stay
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

CPU only, so nothing here can stall a GPU. The C file is compiled on first use with the system's C compiler
(``$CC``, else ``cc``/``gcc``/``clang``; inductor's CPU kernels need one too), ``-O3 -march=native``, into a cache
keyed on the source, the compiler, the flags and the CPU (``$S2T2_NATIVE_CACHE``, else
``$XDG_CACHE_HOME/s2t2_dist/native``): an atomic rename, so ranks that build at once never load a half-written
file. No compiler, a failed build, or ``S2T2_NATIVE=0``: :func:`library` is None, one warning, and the solver uses
the compiled (inductor) passes instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .fused import FUSED_MIN_NUMEL, FusedKernels, fused_available

__all__ = ["NativeKernels", "library", "native_available", "resolve_fused", "MAX_PASSES"]

SOURCE = Path(__file__).with_name("csrc") / "dykstra_cpu.c"
_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c11", "-pthread"]
#: Newton passes per slice at most: the shapes here prove every slice in 2-5; a slice still unproven after this many
#: (a lattice of ties) keeps its lower bound and is counted in ``SimplexProjector.unproven``, as on the fixed path
MAX_PASSES = 32


def _compiler() -> Optional[str]:
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (a cluster's nodes may share a cache dir)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    d = os.environ.get("S2T2_NATIVE_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "s2t2_dist" / "native"


def _build(cc: str, out: Path, march: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *_FLAGS, *(["-march=native"] if march else []), "-o", tmp, str(SOURCE), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build never exposes a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    if os.environ.get("S2T2_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    cc = _compiler()
    if cc is None:
        warnings.warn("s2t2_dist.ot.native: no C compiler (cc/gcc/clang or $CC) found: the sparse Sinkhorn uses the "
                      "compiled inductor passes instead", RuntimeWarning, stacklevel=2)
        return None
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        ver = ""
    src = b"".join(f.read_bytes() for f in sorted(SOURCE.parent.glob("dykstra_cpu*")))  # (the .c and its header)
    last: Optional[Exception] = None
    for march in (True, False):  # a compiler without -march=native still gets a portable build
        key = hashlib.sha256(b"\0".join([src, cc.encode(), ver.encode(), " ".join(_FLAGS).encode(),
                                         str(march).encode(), _cpu_signature().encode()])).hexdigest()[:24]
        path = _cache_dir() / f"dykstra_cpu_{key}.so"
        try:
            if not path.exists():
                _build(cc, path, march)
            return _declare(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            last = e
    warnings.warn(f"s2t2_dist.ot.native: could not build {SOURCE.name} ({last}): the sparse Sinkhorn uses the "
                  "compiled inductor passes instead", RuntimeWarning, stacklevel=2)
    return None


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
