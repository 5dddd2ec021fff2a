"""The sparse Sinkhorn's CUDA route: each Dykstra projection is ONE Triton kernel, forward and backward.

Pure math: no torch.distributed, no I/O. The Dykstra buffers are (v, u) with column-major strides (1, v): a target
column of the plan (v entries, the long slice) is contiguous, and a source row (u entries, the short slice) is
strided by v. A projection is a set of independent slices, so one kernel serves both:

* the COLUMN projection: one program per column, its v entries streamed in chunks of ``BLOCK_N``;
* the ROW projection: one program per ``BLOCK_S`` rows, each row's u entries held whole in registers
  (``ONE_CHUNK``, u <= 512: at least ``MIN_ROWS`` rows a program, loads coalesced along the rows); longer rows are
  streamed in chunks, ``STRIDED_ROWS`` of them a program, so that each load still reads ``STRIDED_ROWS``
  consecutive entries along the strided dimension (a whole 128-byte line) instead of one float in each.

The threshold of each slice is EXACT, found in the program without anything read back to the host: the largest
entry minus the scale and the mean bound (both lower bounds of the threshold), then Newton steps on
``f(t) = sum max(z - t, 0) - s`` (Michelot's fixed point ``t <- t + (sum_{z > t} (z - t) - s) / |{z > t}|``), which
from a lower bound increase monotonically (f is convex and decreasing) and stop when the support stops shrinking:
then ``t`` is the threshold of its own support, i.e. exact. The loop runs while any slice of the program still
shrinks, so its length follows the data (typically 2-4 steps) while the kernel count does not; it ends because a
support count is an integer that only decreases (a count that grows back by rounding stops the slice too, with
``t`` from the larger support). Then the same program writes the projection ``max(z - t, 0)``, Dykstra's correction
``min(z, t)`` and the support mask (what the backward needs) in one more pass.

The backward of a projection with Dykstra's correction term is ``where(S, g - mean_S(g - gc), gc)`` per slice: one
kernel of the same shape (a sums pass and a write pass).

Tested on a CPU by Triton's interpreter (``TRITON_INTERPRET=1``: tests/helpers/scripts/sinkhorn_triton_interpreted.py,
run by tests/ot/test_gpu_kernels.py) against the sort reference; kernels are built on first use, so that the
interpreter switch is read by then.
"""
from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["TritonSteps", "dry_run", "kernels_as", "launches"]

# Tiles of 2,048 float32 over 256 threads (8 a thread): compiled for sm_80 and sm_90 every launch then fits in at
# most ~104 registers without spilling, i.e. at least 2 programs per SM (4,096-entry tiles took 154-255 registers,
# spilled in the row projection and left one program per SM, its Newton loop's reductions unhidden); the figures:
# bench/kernel_resources.md, checked by tests/bench/test_kernel_resources.py.
#: entries of a long slice streamed per chunk (an 8 KB tile of float32 per program)
BLOCK_N = 2048
#: entries per program of the registers path: BLOCK_S slices x next_pow2(N) entries
ROW_TILE = 2048
#: at least this many slices per program on the registers path: 16 bytes of float32 along the strided dim, the
#: other half of each 32-byte sector read by the neighbouring program (from L2)
MIN_ROWS = 4
#: slices per program of a streamed slice whose entries are strided (a row of u > 512 in a column-major plan): a
#: 128-byte line of float32 per load along the strided dim, in chunks of STRIDED_TILE // STRIDED_ROWS entries
#: (compiled offline, 16 x 64 and 16 x 128 tiles spilled on sm_80 in the row projection with corrections; 32 x 32
#: and 8 x 128 do not)
STRIDED_ROWS = 32
STRIDED_TILE = 1024
#: 256 threads a program
NUM_WARPS = 8


def _get():
    if _dry[0]:
        return _DryKernel(), _DryKernel()
    if _replaced[0] is not None:
        return _replaced[0]
    from s2t2_dist.ot import triton_kernels as k

    return k.project, k.backward


#: the kernels launched within kernels_as() (None: the module's own)
_replaced: list = [None]


@contextmanager
def kernels_as(project, backward) -> Iterator[None]:
    """Within: the route launches ``project`` and ``backward`` in place of its kernels, with the same grids and
    arguments (each indexed by its grid, as a Triton kernel is): how a bench records every launch
    (bench/kernel_resources.py) or compares variants of the same kernels (bench/kernel_diag.py)."""
    _replaced[0] = (project, backward)
    try:
        yield
    finally:
        _replaced[0] = None


class _DryKernel:
    """A launch recorded (by the counter) and not run."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


_dry = [False]


@contextmanager
def dry_run() -> Iterator[None]:
    """Within: this route's launches are counted (:data:`launches`) but not run, on any device, Triton or not.
    The route reads nothing back to the host, so which ops and launches it issues does not depend on what the
    kernels compute: this counts a CUDA step's kernels on a CPU at any size (bench/bench_sinkhorn.py, the tests;
    the results are garbage)."""
    _dry[0] = True
    try:
        yield
    finally:
        _dry[0] = False



#: kernel launches by this module since import (a counter for tests and benchmarks: the CUDA route's kernel count)
launches = [0]


def _shape(S: int, N: int, dim: int = 0, *operands: Tensor) -> tuple[int, int, bool]:
    """(BLOCK_S, BLOCK_N, ONE_CHUNK) of S slices of N entries along ``dim``: short slices whole in registers,
    several per program; long ones streamed, one a program, except rows (``dim`` 1: as many as v) whose entries
    are strided in any of the launch's ``operands``: ``STRIDED_ROWS`` a program, coalesced across rows. Columns
    (u of them: too few programs to share) stay one a program."""
    bn = 1 << max(N - 1, 0).bit_length()
    if bn <= ROW_TILE // MIN_ROWS:
        return ROW_TILE // bn, bn, True
    if dim == 1 and any(t.stride(1) != 1 for t in operands):
        return STRIDED_ROWS, max(STRIDED_TILE // STRIDED_ROWS, 1), False
    return 1, BLOCK_N, N <= BLOCK_N


def _slices(t: Tensor, dim: int) -> tuple[int, int]:
    """(stride between slices, stride along a slice) of a 2-D tensor whose slices run along ``dim``."""
    return (t.stride(1 - dim), t.stride(dim))


class TritonSteps:
    """The Dykstra steps (see :mod:`s2t2_dist.ot.dykstra`) by the kernels above: one launch per projection, forward
    and backward. ``mu``, ``nu``: the row and column scales (this rank's columns when sharded)."""

    def __init__(self, mu: Tensor, nu: Tensor):
        self.mu, self.nu = mu, nu

    @staticmethod
    def buffers(C: Tensor):
        v, u = C.shape
        return tuple(torch.empty_strided((v, u), (1, v), dtype=C.dtype, device=C.device) for _ in range(3))

    @staticmethod
    def mask(C: Tensor) -> Tensor:
        v, u = C.shape
        return torch.empty_strided((v, u), (1, v), dtype=torch.bool, device=C.device)

    def _project(self, dim: int, scale: Tensor, z1: Tensor, z2: Tensor | None, add: Tensor | None,
                 pos: Tensor, corr: Tensor) -> tuple[Tensor, Tensor]:
        S, N = z1.shape[1 - dim], z1.shape[dim]
        mask = self.mask(pos)
        cnt = torch.empty(S, dtype=torch.int32, device=z1.device)
        if S:
            a, b = _slices(z1, dim), _slices(pos, dim)
            bs, bn, one = _shape(S, N, dim, z1, pos)
            project, _ = _get()
            launches[0] += 1
            project[(-(-S // bs),)](z1, z1 if z2 is None else z2, pos if add is None else add, pos, corr,
                                    mask.view(torch.uint8), scale, cnt, cnt, S, N, *a, *b, HAS_Z2=z2 is not None,
                                    HAS_ADD=add is not None, APPLY=True, BS=bs, BN=bn, ONE_CHUNK=one, num_warps=NUM_WARPS)
        return mask, cnt

    def row(self, src: Tensor, Pc: Tensor, Qc: Tensor, first: bool) -> tuple[Tensor, Tensor]:
        """A = src (+ Pc); Pc <- min(A, t_row); Qc <- max(A - t_row, 0) (+ Qc). Returns (mask, counts)."""
        return self._project(1, self.mu, src, None if first else Pc, None if first else Qc, Qc, Pc)

    def col(self, Qc: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
        """X <- max(Qc - t_col, 0); Qc <- min(Qc, t_col). Returns (mask, counts)."""
        return self._project(0, self.nu, Qc, None, None, X, Qc)

    def thresholds(self, Z: Tensor, scale: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        """Exact thresholds (float64) of the slices of Z along ``dim`` and their support counts, nothing written."""
        S, N = Z.shape[1 - dim], Z.shape[dim]
        tau = torch.empty(S, dtype=torch.float64, device=Z.device)
        cnt = torch.empty(S, dtype=torch.int32, device=Z.device)
        if S:
            a = _slices(Z, dim)
            bs, bn, one = _shape(S, N, dim, Z)
            project, _ = _get()
            launches[0] += 1
            project[(-(-S // bs),)](Z, Z, Z, Z, Z, cnt, scale, tau, cnt, S, N, *a, *a, HAS_Z2=False, HAS_ADD=False,
                                    APPLY=False, BS=bs, BN=bn, ONE_CHUNK=one, num_warps=NUM_WARPS)
        return tau, cnt

    def _backward(self, dim: int, g: Tensor, gc: Tensor | None, mask: Tensor, cnt: Tensor) -> Tensor:
        out = gc if gc is not None else torch.empty_strided(mask.shape, mask.stride(), dtype=g.dtype,
                                                            device=g.device)
        S, N = mask.shape[1 - dim], mask.shape[dim]
        if dim == 0 and g.stride(0) != 1:
            # an upstream gradient in another layout than the plan's (the product's dP has P's): one copy, so that
            # the streamed columns read it coalesced rather than one float per 32-byte sector
            g = g.t().contiguous().t()
        if S:
            bs, bn, one = _shape(S, N, dim, g, out)
            _, backward = _get()
            launches[0] += 1
            backward[(-(-S // bs),)](g, out if gc is None else gc, out, mask.view(torch.uint8), cnt, S, N,
                                     *_slices(g, dim), *_slices(out, dim), HAS_GC=gc is not None, BS=bs, BN=bn,
                                     ONE_CHUNK=one, num_warps=NUM_WARPS)
        return out

    def row_bwd(self, g: Tensor, gP: Tensor | None, mask: Tensor, cnt: Tensor) -> Tensor:
        return self._backward(1, g, gP, mask, cnt)

    def col_bwd(self, g: Tensor, gQ: Tensor | None, mask: Tensor, cnt: Tensor) -> Tensor:
        return self._backward(0, g, gQ, mask, cnt)

