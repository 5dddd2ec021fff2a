"""Column-sharded Sinkhorn: distributed plumbing around the pure math of ``s2t2_dist.ot``.

Rank r holds the columns ``[col_start, col_end)`` of C (v x u_r) and the matching ``nu`` entries; ``mu`` is
replicated. Column projections are local (the device route of :mod:`s2t2_dist.ot.dykstra`). A row projection
needs every rank's part of each row: it transposes (:class:`ShardedSteps`: ``all_to_all_single`` gives rank r the
whole rows ``[row_start_r, row_end_r)``, their exact thresholds are found locally, ``all_gather`` shares them),
sending about ``(R-1)/R * v * u_r`` entries per rank and row projection (C / R per rank in all). An exact threshold
found by collectives would need a number of rounds that depends on the data, i.e. a host read per round; the
transposition needs two collectives whatever the data. No host reads (every size comes from the shapes).

Only collectives that gloo and NCCL both support are used: ``all_gather``, ``all_reduce`` (sum/min/max) and
``all_to_all_single``. :class:`CommStats` counts the bytes each rank SENDS under the usual ring algorithms
(all_gather: ``(R-1) * b``; all_reduce: ``2 (R-1)/R * b``; all_to_all: what goes to the other ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from s2t2_dist.ot.dykstra import apply_projection, check_plan_shape, compute_dtype, dykstra, projection_backward
from s2t2_dist.ot.routing import steps_for
from s2t2_dist.ot.sinkhorn import log_sinkhorn

__all__ = [
    "CommStats",
    "all_reduce_sum_mean_grad",
    "gather_rows_mean_grad",
    "sharded_softmax_sinkhorn",
    "GroupComm",
    "ShardedSparseSinkhorn",
    "ShardedSteps",
    "shard_bounds",
    "world_of",
]

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def world_of(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group`` (1 process if torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_bounds(u: int, world_size: int, rank: int) -> tuple[int, int]:
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
    calls: dict[str, int] = field(default_factory=dict)
    bytes_by_op: dict[str, int] = field(default_factory=dict)

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

    def __init__(self, group=None, stats: CommStats | None = None):
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

    def all_gather_rows(self, t: Tensor, sizes: list[int]) -> Tensor:
        """Concatenate along dim 0 tensors whose dim-0 size is ``sizes[rank]`` (uneven: padded, then trimmed)."""
        m = max(sizes)
        pad = torch.zeros((m - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        g = self.all_gather(torch.cat([t, pad]))
        return torch.cat([g[r, : sizes[r]] for r in range(self.world_size)])

    def all_to_all(self, flat: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        out = torch.empty(sum(recv_sizes), dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(out, flat.contiguous(), recv_sizes, send_sizes, group=self.group)
        sent = sum(s for r, s in enumerate(send_sizes) if r != self.rank)
        self.stats.add("all_to_all", sent * flat.element_size())
        return out


class ShardedSteps:
    """The Dykstra steps (:mod:`s2t2_dist.ot.dykstra`) of a column-sharded C: the column projections are the
    device route's own (whole columns are local); a row projection transposes. Rank r receives the whole rows
    ``[row_start_r, row_end_r)`` (rows split like :func:`shard_bounds`) by one ``all_to_all``, takes their exact
    thresholds with the device route, and one ``all_gather`` gives every rank every row's threshold and support
    count; each rank then projects its own block. Exact (no threshold search across ranks), 2 collectives and no
    host read per row projection. The row backward all-reduces the per-row sums over the support (v values)."""

    def __init__(self, local, comm: GroupComm, col_sizes: list[int], mu: Tensor):
        self.local, self.comm, self.col_sizes, self.mu = local, comm, list(col_sizes), mu
        v, R = mu.numel(), comm.world_size
        self.row_bounds = [shard_bounds(v, R, r) for r in range(R)]
        self.buffers, self.col, self.col_bwd = local.buffers, local.col, local.col_bwd

    def row_thresholds(self, A: Tensor) -> tuple[Tensor, Tensor]:
        """(thresholds float64, support counts) of every whole row of the sharded matrix, on every rank."""
        comm, me = self.comm, self.comm.rank
        n = A.shape[1]
        send = torch.cat([A[a:b].reshape(-1) for a, b in self.row_bounds])  # (rows [a, b) for rank q, row-major)
        r0, r1 = self.row_bounds[me]
        recv = comm.all_to_all(send, [(b - a) * n for a, b in self.row_bounds],
                               [(r1 - r0) * c for c in self.col_sizes])
        rows = torch.cat([blk.view(r1 - r0, c) for blk, c in zip(recv.split([(r1 - r0) * c for c in self.col_sizes]),
                                                                   self.col_sizes)], 1)  # whole rows, column order
        tau, cnt = self.local.thresholds(rows, self.mu[r0:r1], 1)
        both = comm.all_gather_rows(torch.stack([tau, cnt.to(torch.float64)], 1), [b - a for a, b in self.row_bounds])
        return both[:, 0], both[:, 1]

    def row(self, src: Tensor, Pc: Tensor, Qc: Tensor, first: bool) -> tuple[Tensor, Tensor]:
        A = src if first else src + Pc
        tau, cnt = self.row_thresholds(A)
        return apply_projection(A, tau, 1, Pc, Qc, None if first else Qc), cnt

    def row_bwd(self, g: Tensor, gP: Tensor | None, mask: Tensor, cnt: Tensor) -> Tensor:
        return projection_backward(g, gP, mask, cnt, 1, reduce=lambda s: self.comm.all_reduce(s, "sum"))


class ShardedSparseSinkhorn:
    """Sparse Sinkhorn of a column-sharded C.

    ``mu`` (v, replicated), ``nu_local`` (this rank's columns), ``u`` (all columns), ``group`` (None: the default
    group). ``__call__(C_local, n_iter)`` returns this rank's (v, u_r) block of P, equal to the single-process
    plan's columns; gradients w.r.t. ``C_local`` equal the single-process gradient's columns when each rank's
    upstream gradient is its block of the single-process upstream gradient. ``stats`` counts the bytes sent.
    """

    def __init__(self, mu: Tensor, nu_local: Tensor, u: int, group=None, validate: bool = True):
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
        self._nu_checked = False
        self._steps = None

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

    def _agreed(self, local, device: torch.device, mu: Tensor, nu: Tensor):
        """One route for the job: each rank checked the kernels on its own shard's shapes; if any rank was refused,
        every rank takes the torch steps (the job runs at its slowest rank's pace anyway), and each records which
        rank and why."""
        from s2t2_dist.ot.dykstra import TorchSteps
        from s2t2_dist.ot.routing import kernel_device
        from s2t2_dist.utils import routes

        if not kernel_device(device):  # a CPU: the torch steps on every rank, nothing to agree on
            return local
        mine = routes.ROUTES.get("sinkhorn", {}).get(str(device)) or {}  # what steps_for chose here, and why
        refused_here = bool(mine.get("fallback"))
        flag = torch.tensor([float(refused_here)], dtype=torch.float64, device=device)
        if float(self.comm.all_reduce(flag, "sum")) == 0.0:
            return local
        why_here = mine.get("why", "") if refused_here else ""
        whys = [None] * self.comm.world_size
        dist.all_gather_object(whys, why_here, group=self.comm.group)
        first = next(r for r, w in enumerate(whys) if w)
        if not refused_here:
            routes.record("sinkhorn", device, "torch steps", f"one route for the job: rank {first}'s {whys[first]}",
                          fallback=True)
            local = TorchSteps(mu, nu)
        return local

    def __call__(self, C_local: Tensor, n_iter: int = 3) -> Tensor:
        if self.validate:  # once, as SparseSinkhorn: each check is a host sync and a collective
            self._validate(C_local)
            self.validate = False
        cdt = compute_dtype(C_local.dtype)
        st = self._steps
        if st is None or st.mu.device != C_local.device or st.mu.dtype != cdt:
            check_plan_shape(self.mu.numel(), self.u)
            mu = self.mu.detach().to(device=C_local.device, dtype=cdt).contiguous()
            rows = max(b - a for a, b in (shard_bounds(mu.numel(), len(self.col_sizes), r)
                                          for r in range(len(self.col_sizes))))
            nu = self.nu_local.detach().to(device=C_local.device, dtype=cdt)
            from s2t2_dist.utils.routes import record

            local = steps_for(C_local.device, mu, nu, (tuple(C_local.shape), (rows, self.u)),  # (its columns;
                              on_route=record)  # the whole rows it receives)
            local = self._agreed(local, C_local.device, mu, nu)
            st = self._steps = ShardedSteps(local, self.comm, self.col_sizes, mu)
        return dykstra(C_local, st, n_iter)


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
                             comm: GroupComm | None = None) -> Tensor:
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
    def forward(ctx, x: Tensor, sizes: list[int], comm: GroupComm):
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


def gather_rows_mean_grad(x: Tensor, sizes: list[int], comm: GroupComm) -> Tensor:
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
