"""Column-sharded Sinkhorn: distributed plumbing around the pure math of ``s2t2_dist.ot``.

Rank r holds the columns ``[col_start, col_end)`` of C (v x u_r) and the matching ``nu`` entries; ``mu`` is
replicated. Column projections are local. A row projection needs every rank's part of each row; two ways:

* ``method="threshold"`` (default): the pure :class:`~s2t2_dist.ot.simplex.SimplexProjector` with a
  :class:`GroupComm`: all-reduced per-row sums and max-reduced per-row candidate bounds (each rank's top-k) give
  every rank the same starting lower bound, then each of the fixed number of Newton passes all-reduces per-row
  (sum, count) partials (2 v numbers). The backward pass of a row projection needs one all-reduce of per-row sums
  over the support (v values). No host reads (the fallback's extra passes all-reduce their partials too).
  Below ``sort_max`` entries of C (small plans, where bandwidth does not matter) every rank all-gathers the rows
  whole and takes the exact threshold from a sort (as the local projections do there).
* ``method="alltoall"``: transpose by ``all_to_all_single`` (rank r receives whole rows ``[row_start_r,
  row_end_r)``), project locally, all-gather the row thresholds and counts; each rank then
  takes its support mask by one pass over its block. Same backward. Sends about ``(R-1)/R * v * u_r * 4`` bytes
  per row projection. No host reads either (every size comes from the shapes).

Only collectives that gloo and NCCL both support are used: ``all_gather``, ``all_reduce`` (sum/min/max) and
``all_to_all_single``. :class:`CommStats` counts the bytes each rank SENDS under the usual ring algorithms
(all_gather: ``(R-1) * b``; all_reduce: ``2 (R-1)/R * b``; all_to_all: what goes to the other ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from s2t2_dist.ot.sinkhorn import DEFAULT_COL_K, DEFAULT_ROW_K, Scratch, dykstra, log_sinkhorn, set_kernels
from s2t2_dist.ot.simplex import SORT_MAX_ENTRIES, SimplexProjector, Support, compute_dtype

__all__ = [
    "AllToAllRowProjector",
    "CommStats",
    "all_reduce_sum_mean_grad",
    "gather_rows_mean_grad",
    "sharded_softmax_sinkhorn",
    "GroupComm",
    "ShardedSparseSinkhorn",
    "shard_bounds",
    "world_of",
]

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def world_of(group=None) -> Tuple[int, int]:
    """(rank, world size) in ``group`` (1 process if torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_bounds(u: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Columns ``[start, end)`` of rank ``rank`` when ``u`` columns are split over ``world_size`` ranks: the first
    ``u % world_size`` ranks get one extra column (shard sizes differ by at most one; some may be empty if u < R)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    base, extra = divmod(u, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class CommStats:
    """Bytes this rank sends (ring-algorithm model) and calls, per collective."""

    bytes_sent: int = 0
    calls: Dict[str, int] = field(default_factory=dict)
    bytes_by_op: Dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: float) -> None:
        self.bytes_sent += int(nbytes)
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0) + int(nbytes)

    def reset(self) -> None:
        self.bytes_sent = 0
        self.calls.clear()
        self.bytes_by_op.clear()


class GroupComm:
    """The ``comm`` interface of :mod:`s2t2_dist.ot.simplex` over a torch.distributed process group."""

    def __init__(self, group=None, stats: Optional[CommStats] = None):
        self.group = group
        self.rank, self.world_size = world_of(group)
        self.stats = stats if stats is not None else CommStats()

    def all_gather(self, t: Tensor) -> Tensor:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        self.stats.add("all_gather", (self.world_size - 1) * t.numel() * t.element_size())
        return torch.stack(out)

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        t = t.contiguous().clone()
        dist.all_reduce(t, op=_OPS[op], group=self.group)
        R = self.world_size
        self.stats.add("all_reduce", 2 * (R - 1) / R * t.numel() * t.element_size())
        return t

    def all_gather_rows(self, t: Tensor, sizes: List[int]) -> Tensor:
        """Concatenate along dim 0 tensors whose dim-0 size is ``sizes[rank]`` (uneven: padded, then trimmed)."""
        m = max(sizes)
        pad = torch.zeros((m - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        g = self.all_gather(torch.cat([t, pad]))
        return torch.cat([g[r, : sizes[r]] for r in range(self.world_size)])

    def all_to_all(self, flat: Tensor, send_sizes: List[int], recv_sizes: List[int]) -> Tensor:
        out = torch.empty(sum(recv_sizes), dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(out, flat.contiguous(), recv_sizes, send_sizes, group=self.group)
        sent = sum(s for r, s in enumerate(send_sizes) if r != self.rank)
        self.stats.add("all_to_all", sent * flat.element_size())
        return out


class AllToAllRowProjector(SimplexProjector):
    """Row projection of a column-sharded (v, u_r) matrix by transposition (``method="alltoall"``).

    Rank r receives the whole rows ``[row_start_r, row_end_r)`` (rows split like :func:`shard_bounds`), projects
    them with a local projector, and the thresholds and counts of all rows are all-gathered; the local support is
    then one pass ``z > tau`` over the local block. The backward pass (``slice_sums``) is inherited: one
    all-reduce of per-row sums.
    """

    def __init__(self, scale: Tensor, n_total: int, col_sizes: List[int], comm: GroupComm, k: int = DEFAULT_ROW_K):
        super().__init__(scale, n_total=n_total, k=k, comm=comm)
        v = self.scale.numel()
        R = comm.world_size
        self.col_sizes = list(col_sizes)
        self.row_bounds = [shard_bounds(v, R, r) for r in range(R)]
        r0, r1 = self.row_bounds[comm.rank]
        self.local = SimplexProjector(self.scale[r0:r1], n_total=n_total, k=k)

    def threshold(self, z3: Tensor, with_mask: bool = True, slot=None) -> Tuple[Tensor, Support]:
        v, n, _ = z3.shape
        comm = self.comm
        me = comm.rank
        z2 = z3.view(v, n)
        send = torch.cat([z2[a:b].reshape(-1) for a, b in self.row_bounds])
        r0, r1 = self.row_bounds[me]
        recv = comm.all_to_all(send, [(b - a) * n for a, b in self.row_bounds],
                               [(r1 - r0) * c for c in self.col_sizes])
        blocks, off = [], 0
        for c in self.col_sizes:
            blocks.append(recv[off: off + (r1 - r0) * c].view(r1 - r0, c))
            off += (r1 - r0) * c
        rows = torch.cat(blocks, 1).contiguous()  # (r1 - r0, u): whole rows, global column order
        self.local.scale = self.scale[r0:r1]
        tau_l, sup_l = self.local.threshold(rows.view(r1 - r0, -1, 1), with_mask=False, slot=slot)  # (counts only)
        self.unproven = self.local.unproven
        both = torch.stack([tau_l.double(), sup_l.counts.double()], 1)
        allv = comm.all_gather_rows(both, [b - a for a, b in self.row_bounds])
        tau = allv[:, 0].to(z3.dtype)
        return tau, Support("mask", allv[:, 1].to(z3.dtype), z3 > tau.view(v, 1, 1) if with_mask else None)


class ShardedSparseSinkhorn:
    """Sparse Sinkhorn of a column-sharded C, with persistent projectors (warm starts between calls).

    ``mu`` (v, replicated), ``nu_local`` (this rank's columns), ``u`` (all columns), ``group`` (None: the default
    group). ``__call__(C_local, n_iter)`` returns this rank's (v, u_r) block of P; gradients w.r.t. ``C_local``
    equal the single-process gradient's columns when each rank's upstream gradient is its block of the
    single-process upstream gradient. ``stats`` counts the bytes sent. ``fused``: compiled pass kernels, as in
    :class:`~s2t2_dist.ot.sinkhorn.SparseSinkhorn` (every pass's per-slice partials are still all-reduced).
    """

    def __init__(self, mu: Tensor, nu_local: Tensor, u: int, group=None, method: str = "threshold",
                 row_k: int = DEFAULT_ROW_K, col_k: int = DEFAULT_COL_K, validate: bool = True, fused="auto",
                 sort_max: int = SORT_MAX_ENTRIES):
        self.fused = fused
        if method not in ("threshold", "alltoall"):
            raise ValueError(f"method must be 'threshold' or 'alltoall', got {method!r}")
        self.stats = CommStats()
        self.comm = GroupComm(group, self.stats)
        self.mu, self.nu_local, self.u = mu, nu_local, int(u)
        self.validate = validate
        R = self.comm.world_size
        if self.u < R:
            raise ValueError(f"u={u} target tokens cannot be column-sharded over {R} ranks (every rank needs a column)")
        self.col_sizes = [b - a for a, b in (shard_bounds(self.u, R, r) for r in range(R))]
        if self.col_sizes[self.comm.rank] != nu_local.numel():
            raise ValueError(
                f"nu_local has {nu_local.numel()} entries but rank {self.comm.rank} of {R} owns "
                f"{self.col_sizes[self.comm.rank]} of the u={u} columns (see shard_bounds)")
        cdt = compute_dtype(mu.dtype)
        if method == "threshold":
            self.rows = SimplexProjector(mu.detach().to(cdt), n_total=self.u, k=row_k, comm=self.comm,
                                         sort_max=sort_max)
        else:
            self.rows = AllToAllRowProjector(mu.detach().to(cdt), self.u, self.col_sizes, self.comm, k=row_k)
            self.rows.local.sort_max = sort_max
        self.cols = SimplexProjector(nu_local.detach().to(cdt), k=col_k, sort_max=sort_max)
        self._nu_checked = False
        self.scratch: Optional[Scratch] = None

    def _validate(self, C: Tensor) -> None:
        from s2t2_dist.ot.sinkhorn import validate_plan_inputs

        if not self._nu_checked:
            tot = self.comm.all_reduce(self.nu_local.detach().double().sum().reshape(1), "sum")
            self._nu_total = float(tot)
            self._nu_checked = True
        bad = torch.zeros(1, dtype=torch.float64, device=C.device)
        try:
            validate_plan_inputs(C, self.mu, self.nu_local, nu_total=self._nu_total)
        except ValueError:
            bad += 1
            self.comm.all_reduce(bad, "sum")
            raise
        if float(self.comm.all_reduce(bad, "sum")) > 0:
            raise ValueError("another rank's inputs failed validation (see its error)")

    def unproven(self) -> Optional[Tensor]:
        """This rank's slices (all calls so far) whose threshold was left a lower bound: a device tensor."""
        parts = [p.unproven for p in (self.rows, self.cols) if getattr(p, "unproven", None) is not None]
        return sum(parts) if parts else None

    def __call__(self, C_local: Tensor, n_iter: int = 3, drop_below: Optional[Tensor] = None) -> Tensor:
        if self.validate:  # once, as SparseSinkhorn: each check is a host sync and a collective
            self._validate(C_local)
            self.validate = False
        cdt = compute_dtype(C_local.dtype)
        for p, m in ((self.rows, self.mu), (self.cols, self.nu_local)):
            if p.scale.dtype != cdt or p.scale.device != C_local.device:
                p.scale = m.detach().to(device=C_local.device, dtype=cdt)
        projs = (self.rows, self.cols) + ((self.rows.local,) if isinstance(self.rows, AllToAllRowProjector) else ())
        set_kernels(projs, self.fused, C_local)
        self.scratch = Scratch.reuse(self.scratch, C_local.device)
        return dykstra(C_local, self.rows, self.cols, n_iter, self.scratch, drop_below)


# --------------------------------------------------------------------------------------------------------------
# softmax rows across ranks (dense baseline, sharded)
# --------------------------------------------------------------------------------------------------------------


class _DistRowLogSoftmax(torch.autograd.Function):
    """``log_softmax(row i)`` of a column-sharded matrix: the row max and the sum of exponentials all-reduced.

    Backward: ``grad = g - softmax * sum_j g_j``, the row sum all-reduced."""

    @staticmethod
    def forward(ctx, z: Tensor, comm: GroupComm):
        zd = z.detach()
        local_max = zd.amax(1) if zd.shape[1] else zd.new_full((zd.shape[0],), float("-inf"))
        m = comm.all_reduce(local_max, "max")
        lse = comm.all_reduce((zd - m.unsqueeze(1)).exp().sum(1), "sum").log_() + m
        out = zd - lse.unsqueeze(1)
        ctx.comm = comm
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (out,) = ctx.saved_tensors
        gsum = ctx.comm.all_reduce(g.sum(1), "sum")
        return g - out.exp() * gsum.unsqueeze(1), None


def sharded_softmax_sinkhorn(C_local: Tensor, mu: Tensor, nu_local: Tensor, group=None, n_iter: int = 3,
                             comm: Optional[GroupComm] = None) -> Tensor:
    """The dense baseline (log-domain Sinkhorn, see :func:`~s2t2_dist.ot.sinkhorn.softmax_sinkhorn`) on a
    column-sharded C: two all-reduces of v numbers per row step; equals the single-process result."""
    comm = comm or GroupComm(group)
    return log_sinkhorn(C_local, mu, nu_local, n_iter, lambda Z: _DistRowLogSoftmax.apply(Z, comm))


# --------------------------------------------------------------------------------------------------------------
# autograd-aware collectives for replicated results (the "mean over ranks" gradient convention)
# --------------------------------------------------------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """Forward: concatenate every rank's rows (uneven sizes). Backward: the gradient of this rank's rows is the
    MEAN over ranks of their upstream gradients (all-reduce, slice, divide by R)."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], comm: GroupComm):
        ctx.comm, ctx.sizes = comm, sizes
        return comm.all_gather_rows(x.detach(), sizes)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        comm = ctx.comm
        gs = comm.all_reduce(g, "sum")
        start = sum(ctx.sizes[: comm.rank])
        return gs[start: start + ctx.sizes[comm.rank]].div_(comm.world_size), None, None


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over ranks. Backward: the MEAN over ranks of the upstream gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: GroupComm):
        ctx.comm = comm
        return comm.all_reduce(x.detach(), "sum")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        return ctx.comm.all_reduce(g, "sum").div_(ctx.comm.world_size), None


def gather_rows_mean_grad(x: Tensor, sizes: List[int], comm: GroupComm) -> Tensor:
    """All-gather rows (rank r contributes ``sizes[r]`` rows), differentiable; see :class:`_GatherRows`.

    Convention: every rank differentiates its own loss L_q; the gradient reaching ``x`` on rank r is
    ``(1/R) * sum_q dL_q/dx_r``, i.e. that of the mean loss ``(1/R) sum_q L_q``: the single-process gradient when
    every rank computes the same loss, the DDP-averaged one when ranks see different data."""
    if comm.world_size == 1:
        return x
    return _GatherRows.apply(x, list(sizes), comm)


def all_reduce_sum_mean_grad(x: Tensor, comm: GroupComm) -> Tensor:
    """Sum over ranks, differentiable with the same "mean loss" convention as :func:`gather_rows_mean_grad`."""
    if comm.world_size == 1:
        return x
    return _AllReduceSum.apply(x, comm)
