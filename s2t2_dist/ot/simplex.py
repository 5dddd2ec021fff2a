"""Scaled sparsemax: Euclidean projection onto {p >= 0, sum p = scale}, and its building blocks.

Pure math: no torch.distributed, no I/O. The distributed row projection (``s2t2_dist.distributed``) reuses the same
building blocks by passing a ``comm`` object whose ``all_gather``/``all_reduce`` are collectives; here they are the
identity (:class:`LocalComm`).

No host synchronisation: nothing here reads a tensor value back to the host (no ``.item()``/``int()``/``bool()``,
``nonzero``, boolean indexing, ``unique``), and every shape depends on the input's shape only, so a GPU never waits
for the CPU. Branching is done with masks (``torch.where``); every slice runs the same fixed number of passes.

Threshold algorithm (per slice ``z`` of length ``n``, scale ``s >= 0``): the projection is ``max(z - tau, 0)`` where
``tau`` is the unique root of ``f(tau) = sum_i max(z_i - tau, 0) - s`` (convex, piecewise linear, decreasing). For
``z`` sorted decreasingly and ``t_j = (z_(1) + ... + z_(j) - s) / j``, ``tau = max_j t_j``, so the threshold of any
set of top elements is a LOWER bound of ``tau``.

1. Start from the best of two lower bounds: ``(sum z - s) / n`` (exact when the support is everything, e.g. the
   paper's initialisation where all entries tie) and ``max_{j <= k} t_j`` over the top ``k`` values (exact when the
   support has at most ``k`` elements, typical of rows; with sharded slices, the max over ranks of each rank's own
   candidate bound). WARM START (opt-in, ``warm_iters`` > 0; a call with a ``slot`` that has a previous threshold,
   e.g. the same projection of the previous training step): one pass at the previous threshold ``t`` and one
   Newton step from there, which lands at or below the root from ANY ``t`` (f is convex), and at least the cold
   bound; then only ``warm_iters`` Newton steps. Fewer passes, but where the support changes wholesale between
   calls (the first step from an exactly sparse C) fewer slices are proven than from the cold bound's ``iters``.
2. ``iters`` Newton steps on ``f`` (Michelot's fixed point) ``S <- {z > tau}; tau <- (sum_S z - s) / |S|``: from a
   lower bound, tau increases monotonically and reaches the exact root once S stops changing (finitely many steps;
   at most 3 at the S2T2 shapes from these starting points). A slice is PROVEN exact when its support count did not
   change in the last step: then tau is the exact threshold of its support, ``(sum_S z - s) / |S|``.
3. Fixed-size fallback: up to ``fallback`` slices not proven exact are copied out (a contiguous (f, n) block) and
   get ``FALLBACK_ITERS`` more Newton passes there (cheap: f slices, not all). Slices still unproven (never seen
   in tests or benchmarks) keep their lower bound and are counted in :attr:`SimplexProjector.unproven` (a device
   tensor; read it on logging steps). The functional :func:`sparsemax` (``exact=True``) instead iterates until
   every slice is proven (host reads).

The support of every slice is a bool mask (:class:`Support`), which is all the backward pass needs: on the
support ``S`` the Jacobian-vector product is ``g - mean_S(g)``, zero elsewhere.

Each pass (the starting bounds, every Newton step) is either a few eager ops (the reference) or one compiled kernel
(:mod:`s2t2_dist.ot.fused`, ``SimplexProjector.kernels``): same steps, same supports, sums in another order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .fused import FusedKernels, lower_bound, newton_step, warm_bound

__all__ = [
    "LocalComm",
    "Support",
    "SimplexProjector",
    "compute_dtype",
    "sparsemax",
    "threshold_from_sorted_candidates",
    "DEFAULT_ITERS",
    "DEFAULT_FALLBACK",
    "DEFAULT_WARM_ITERS",
    "SORT_MAX_ENTRIES",
]

NEG_INF = float("-inf")
DEFAULT_ITERS = 6  # Newton passes per projection (the last one proves convergence)
# Newton passes after a warm start, when one is asked for (``warm_iters``): 5 passes in all against the cold
# start's 7, ~20% of the CPU fwd + bwd at 50,304 x 512. 2 (the fewest that can prove a slice) left hundreds of
# slices unproven when C moved 100x the recommended step, or sat on a lattice of ties; 4 left as few as the cold
# start there (bench/bench_sinkhorn.py --moving). Off in the shipped solvers (warm_iters defaults to 0): from the
# FVT start, whose C has exact zeros, the first Adam step changes supports wholesale, and in the full-size
# rehearsal's translate2 leg 4 warm passes left 49,943 of 50,280 rows unproven at step 2 and, with the rows cold,
# still 1 column (the cold bound's 6 passes: 0)
DEFAULT_WARM_ITERS = 4
DEFAULT_FALLBACK = 16  # slices per projection that get FALLBACK_ITERS more passes when Newton did not converge
FALLBACK_ITERS = 16
#: projections of at most this many entries (over all ranks) take the exact threshold from a sort instead of the
#: Newton passes: cheaper there, and exact whatever the support sizes (6 passes + the fallback left hundreds of
#: slices unproven on moved 300-512 x 512 plans, gradients off by 2%; BENCHMARKS.md "#21 (session 5)")
SORT_MAX_ENTRIES = 1 << 20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    if dtype == torch.float64:
        return torch.float64
    if not dtype.is_floating_point:
        raise TypeError(f"sparsemax needs a floating point tensor, got dtype {dtype}")
    return torch.float32


class LocalComm:
    """The single-process 'communicator': every collective is the identity.

    A distributed implementation (see ``s2t2_dist.distributed.sharded_sinkhorn.GroupComm``) provides the same three
    members; the threshold code below calls nothing else.
    """

    world_size = 1

    def all_gather(self, t: Tensor) -> Tensor:
        """Stack ``t`` from every rank along a new leading dim: (world_size, *t.shape)."""
        return t.unsqueeze(0)

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """Reduce ``t`` over ranks with ``op`` in {"sum", "min", "max"} and return the result."""
        return t


# --------------------------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------------------------


def threshold_from_sorted_candidates(cands: Tensor, scale: Union[Tensor, float], dim: int = 0,
                                     with_count: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Threshold of the simplex projection restricted to the given candidates.

    ``cands`` holds the largest values of each slice, sorted decreasingly along ``dim`` (``-inf`` padding allowed at
    the end). Returns ``(tau, count)`` with ``tau = max_j (cands_1 + ... + cands_j - scale) / j`` (computed in
    float64, shape of ``cands`` without ``dim``) and ``count`` the maximising ``j`` (int64). ``tau`` is a lower bound
    of the threshold of the full slice, and is exact when every element outside the candidates is ``<= tau``.
    (``with_count=False``: ``count`` is None, one reduction less.)
    """
    c = cands.double()
    n = c.shape[dim]
    if n == 0:
        raise ValueError("threshold_from_sorted_candidates: no candidates")
    cs = c.cumsum(dim)
    shape = [1] * c.dim()
    shape[dim] = n
    j = torch.arange(1, n + 1, dtype=torch.float64, device=c.device).view(shape)
    s = scale if not isinstance(scale, Tensor) else scale.double().unsqueeze(dim)
    t = (cs - s) / j
    # (amax + argmax: max(dim) with indices was pathologically slow on small tensors with 2 busy threads)
    return t.amax(dim), (t.argmax(dim) + 1 if with_count else None)


@dataclass
class Support:
    """Support (positions with output > 0) of every slice of a simplex projection, as a bool mask.

    ``kind``: always ``"mask"`` (kept so saved supports rebuild as ``Support(kind, *tensors)``); ``counts``: support
    size per slice (float, compute dtype; sharded slices count every rank); ``mask``: bool (O, n, I).
    """

    kind: str
    counts: Tensor
    mask: Optional[Tensor]  # None until the projection pass writes it (``threshold(..., with_mask=False)``)

    def tensors(self):
        return [self.counts, self.mask]

    def nnz(self) -> Tensor:
        """Number of support entries over all slices, a 0-d tensor (no host read; ``int()`` it on logging steps)."""
        return self.counts.sum()


def _support(z3: Tensor, tau_c: Tensor, counts: Tensor, with_mask: bool) -> Tuple[Tensor, Support]:
    """(tau, the support of ``max(z3 - tau, 0)``); ``with_mask=False`` leaves its mask to the projection pass."""
    O, n, I = z3.shape
    return tau_c, Support("mask", counts.to(z3.dtype), z3 > tau_c.view(O, 1, I) if with_mask else None)


def _slices_2d(z3: Tensor) -> Tuple[Tensor, int]:
    """The slices of ``z3`` (O, n, I) as a 2-D tensor (a view when O == 1 or I == 1), and the dim they run along."""
    O, n, I = z3.shape
    if I == 1:
        return z3.view(O, n), 1
    if O == 1:
        return z3.view(n, I), 0
    return z3.permute(1, 0, 2).reshape(n, O * I), 0


class SimplexProjector:
    """Projection of every slice of a tensor onto the scaled simplex, without host synchronisation.

    ``scale``: one value per slice (flat, length O*I). ``n_total``: slice length over all ranks (``None``: the local
    length). ``k``: top candidates per slice and rank (a starting bound, speed only). ``comm``: :class:`LocalComm` or
    a distributed equivalent (slices split across ranks along their length; every reduction is all-reduced, so all
    ranks compute the same thresholds). ``iters``: Newton passes (>= 2). ``fallback``: slices per call that may get
    more passes (see the module docstring). ``exact``: iterate (reading a flag on the host) until every slice is
    proven exact, instead of counting the unproven ones. ``kernels``: a :class:`~s2t2_dist.ot.fused.FusedKernels`
    (one fused kernel per pass, no C-sized temporaries) or None (eager ops; the reference). ``warm_iters``: Newton
    passes after a warm start (0, the default: never start warm; e.g. ``DEFAULT_WARM_ITERS``); the thresholds of each
    ``slot`` are then kept for the next call.

    ``threshold(z3) -> (tau, support)`` does not modify ``z3``; ``slice_sums`` (backward) reduces per-slice sums over
    the support across ranks. ``unproven``: running count (device tensor) of slices whose threshold was left a lower
    bound (0 unless the fixed iterations and the fallback were not enough).
    """

    chunk = 1 << 18  # elements per block of slices (1 MiB of float32: a core's L2 cache)

    def __init__(self, scale: Tensor, n_total: Optional[int] = None, k: int = 16, comm=None,
                 iters: int = DEFAULT_ITERS, fallback: int = DEFAULT_FALLBACK, exact: bool = False,
                 sort_max: int = SORT_MAX_ENTRIES, warm_iters: int = 0):
        self.scale = scale.reshape(-1)
        self.n_total = n_total
        self.k = int(k)
        self.comm = comm or LocalComm()
        self.iters = int(iters)
        self.fallback = int(fallback)
        self.exact = exact
        self.sort_max = int(sort_max)
        self.unproven: Optional[Tensor] = None
        self.kernels: Optional[FusedKernels] = None
        self.warm_iters = int(warm_iters)
        self._warm: dict = {}  # slot -> the last float64 thresholds found there (device tensors, no host read)
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if self.iters < 2:
            raise ValueError(f"iters must be >= 2 (the last Newton pass proves convergence), got {iters}")
        if self.warm_iters < 0 or self.warm_iters == 1:
            raise ValueError(f"warm_iters must be 0 (no warm starts) or >= 2, got {warm_iters}")

    def _warm_start(self, slot, S: int, dev: torch.device) -> Optional[Tensor]:
        """The thresholds ``slot`` found last time, when usable for S slices on ``dev`` (a host-side check)."""
        if slot is None or not self.warm_iters:
            return None
        t = self._warm.get(slot)
        return t if t is not None and t.numel() == S and t.device == dev else None

    def reset_warm(self) -> None:
        """Forget the warm starts (e.g. before a C unrelated to the previous calls'; never needed for exactness)."""
        self._warm.clear()

    def threshold(self, z3: Tensor, with_mask: bool = True, slot=None) -> Tuple[Tensor, Support]:
        """Exact thresholds ``tau`` (one per slice, compute dtype) and the support of ``max(z3 - tau, 0)``
        (``with_mask=False``: the support's mask is left None, for a projection pass that writes it anyway).
        ``slot``: a key under which the thresholds are kept as the next call's warm start (None: a cold start)."""
        O, n, I = z3.shape
        dev, cdt = z3.device, z3.dtype
        n_total = self.n_total if self.n_total is not None else n
        scale = self.scale.to(device=dev, dtype=torch.float64)
        if scale.numel() != O * I:
            raise ValueError(f"scale has {scale.numel()} values for {O * I} slices")
        z2, rd = _slices_2d(z3)
        if self.kernels is None and n_total * O * I <= self.sort_max:
            tau, counts = self._sorted(z2, rd, scale)
            if self.unproven is None:
                self.unproven = torch.zeros((), dtype=torch.int64, device=dev)
            return _support(z3, tau.to(cdt), counts, with_mask)
        warm = self._warm_start(slot, O * I, dev)
        if self.kernels is not None and self.comm.world_size == 1 and self.k == 1 and z2.numel():
            # unsharded: the bound and every Newton pass in one compiled graph (no collective between passes)
            if warm is None:
                tau, counts, changed = self.kernels("chain", z2, rd, scale, n_total, self.iters)
            else:
                tau, counts, changed = self.kernels("chain_warm", z2, rd, scale, n_total, warm, self.warm_iters)
            return self._finish(z2, z3, rd, scale, tau, counts, changed, with_mask, slot)
        # blocks of slices small enough to stay in cache: the Newton passes then re-read cache, not memory (one
        # block when sharded, where every block would cost its own collectives)
        S = z2.shape[1 - rd]
        # (at least 16 strided slices: whole 64-byte cache lines)
        # (fused kernels stream the whole matrix once per pass: one block)
        step = S if self.comm.world_size > 1 or self.kernels is not None else \
            max(1 if rd == 1 else 16, self.chunk // max(n, 1))
        parts = []
        for a in range(0, S, step):
            zb, sb = z2.narrow(1 - rd, a, min(step, S - a)), scale[a: a + step]
            if warm is None:
                parts.append(self._newton(zb, rd, self._lower_bound(zb, rd, sb, n_total), sb))
            else:
                parts.append(self._newton(zb, rd, self._warm_bound(zb, rd, warm[a: a + step], sb, n_total), sb,
                                          self.warm_iters))
        tau, counts, changed = (torch.cat(x) for x in zip(*parts))
        return self._finish(z2, z3, rd, scale, tau, counts, changed, with_mask, slot)

    def _finish(self, z2: Tensor, z3: Tensor, rd: int, scale: Tensor, tau: Tensor, counts: Tensor, changed: Tensor,
                with_mask: bool, slot=None) -> Tuple[Tensor, Support]:
        """Fallback passes for unproven slices (step 3), the unproven count, the warm start kept, the support."""
        if self.fallback > 0:
            tau, counts, changed = self._fallback(z2, rd, scale, tau, counts, changed)
        if self.exact:
            while bool(changed.any()):  # host read: the functional API only, never inside the Sinkhorn
                tau, counts, changed = self._newton(z2, rd, tau, scale)
        left = changed.sum()
        self.unproven = left if self.unproven is None else self.unproven + left
        if slot is not None and self.warm_iters:
            self._warm[slot] = tau
        return _support(z3, tau.to(z3.dtype), counts, with_mask)

    def _sorted(self, z2: Tensor, rd: int, scale: Tensor) -> Tuple[Tensor, Tensor]:
        """Exact thresholds from whole sorted slices, ``tau = max_j (z_(1) + ... + z_(j) - s) / j`` (float64), and
        the support counts, with no host read. Sharded slices are gathered first (small projections only): every
        rank sorts the same whole slices, so all ranks get the same thresholds."""
        full = z2
        if self.comm.world_size > 1:
            # shards differ by at most one element (the column split): pad to the largest with -inf, which sorts
            # last and never counts (its t_j is -inf)
            W = self.comm.world_size
            n_total = self.n_total if self.n_total is not None else z2.shape[rd] * W
            pad = -(-n_total // W) - z2.shape[rd]
            if pad > 0:
                shape = list(z2.shape)
                shape[rd] = pad
                z2 = torch.cat([z2, z2.new_full(shape, NEG_INF)], dim=rd)
            full = torch.cat(list(self.comm.all_gather(z2.contiguous()).unbind(0)), dim=rd)
        # sorted along contiguous memory (a strided sort of long columns costs ~4x more on CPU)
        rows = full if rd == 1 else full.t().contiguous()
        tau = threshold_from_sorted_candidates(rows.sort(dim=1, descending=True).values, scale, 1,
                                               with_count=False)[0]
        # counted as the mask will be (tau in the compute dtype), so the backward's |S| matches its support
        counts = (full > tau.to(full.dtype).unsqueeze(rd)).sum(rd)
        return tau, counts

    def _lower_bound(self, z2: Tensor, rd: int, scale: Tensor, n_total: int) -> Tensor:
        """max((sum z - s) / n, best threshold of the top-k candidates) per slice, float64 (step 1).

        The threshold ``(sum_A z - s) / |A|`` of ANY subset A is a lower bound, so with sharded slices each rank's
        local candidates give one and the bounds are max-reduced: v numbers, not the k v of gathering candidates."""
        comm = self.comm
        n_local = z2.shape[rd]
        kl = min(self.k, n_local)
        if self.kernels is not None and n_local > 0:
            sums, mx = self.kernels("bounds", z2, rd)  # both in one pass
        else:
            sums, mx = z2.sum(rd), None
        sums = comm.all_reduce(sums, "sum").double()
        if kl == 0:  # an empty shard: no local candidates
            cand = torch.full_like(sums, NEG_INF)
        elif kl == 1:  # the maximum: a plain reduction, much cheaper than topk
            cand = (z2.amax(rd) if mx is None else mx).double() - scale
        else:
            vals = z2.topk(kl, dim=rd).values
            vals = vals.t() if rd == 1 else vals  # (kl, S), sorted decreasingly
            cand = threshold_from_sorted_candidates(vals, scale, 0, with_count=False)[0]
        if comm.world_size > 1:
            cand = comm.all_reduce(cand.to(z2.dtype), "max").double()
        return lower_bound(sums, cand, scale, n_total)

    def _warm_bound(self, z2: Tensor, rd: int, warm: Tensor, scale: Tensor, n_total: int) -> Tensor:
        """The warm start's lower bound (see :func:`~s2t2_dist.ot.fused.warm_bound`): one pass at ``warm``, reduced
        over ranks."""
        t = warm.to(z2.dtype)
        if z2.shape[rd] == 0:  # an empty shard
            dsum = cnt = sums = torch.zeros_like(t)
            mx = torch.full_like(t, NEG_INF)
        elif self.kernels is not None:
            dsum, cnt, sums, mx = self.kernels("warm", z2, rd, t)
        else:
            r = (z2 - t.unsqueeze(rd)).clamp_(min=0)
            sums, mx, dsum, cnt = z2.sum(rd), z2.amax(rd), r.sum(rd), r.sign_().sum(rd)
        dsum, cnt, sums = self.comm.all_reduce(torch.stack([dsum, cnt, sums]), "sum").double()
        if self.comm.world_size > 1:
            mx = self.comm.all_reduce(mx, "max")
        return warm_bound(t, dsum, cnt, sums, mx, scale, n_total)

    def _newton(self, z2: Tensor, rd: int, tau: Tensor, scale: Tensor,
                iters: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """``iters`` Newton steps from the lower bound ``tau`` (step 2): (tau, support counts, not proven) per
        slice. Each step is one pass (count and sum of ``z - tau`` above tau), all-reduced over ranks. The update
        ``tau + (sum_S (z - tau) - s) / |S|`` equals ``(sum_S z - s) / |S|`` but keeps its precision when the values
        are large and close (the projection is shift-invariant)."""
        prev = None
        for _ in range(iters or self.iters):
            t = tau.to(z2.dtype)
            if self.kernels is not None and z2.numel():
                dsum, cnt = self.kernels("newton", z2, rd, t)
            else:
                r = (z2 - t.unsqueeze(rd)).clamp_(min=0)  # > 0 exactly where z > t (IEEE subtraction)
                # plain sums in the compute dtype (a float64 accumulator or count_nonzero is ~10x slower on CPU);
                # the counts are exact in float32 below 2**24 elements per slice and rank
                dsum, cnt = r.sum(rd), r.sign_().sum(rd)
            dsum, cnt = self.comm.all_reduce(torch.stack([dsum, cnt]), "sum").double()
            tau = newton_step(tau, t, dsum, cnt, scale)
            changed, prev = (None if prev is None else cnt != prev), cnt
        return tau, prev, changed

    def _fallback(self, z2: Tensor, rd: int, scale: Tensor, tau: Tensor, counts: Tensor,
                  changed: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Up to ``fallback`` slices not proven exact get ``FALLBACK_ITERS`` more Newton passes, on a contiguous
        copy of just those slices (step 3: a fixed size, whatever the data; the slices are the same on every rank,
        being chosen from reduced counts)."""
        S = z2.shape[1 - rd]
        f = min(self.fallback, S)
        pick = changed.to(torch.float32).topk(f).indices  # the unproven slices first (any others keep their values)
        zs = z2.index_select(1 - rd, pick)
        zs = zs.t().contiguous() if rd == 0 else zs  # (f, n)
        t, c, ch = self._newton(zs, 1, tau.index_select(0, pick), scale.index_select(0, pick), FALLBACK_ITERS)
        use = changed.index_select(0, pick)
        tau = tau.index_copy(0, pick, torch.where(use, t, tau.index_select(0, pick)))
        counts = counts.index_copy(0, pick, torch.where(use, c, counts.index_select(0, pick)))
        return tau, counts, changed.index_copy(0, pick, use & ch)

    # ------------------------------------------------------------------ backward helper
    def slice_sums(self, support: Support, h: Tensor) -> Tensor:
        """Per-slice sums of ``h`` (O, n, I) over the support, reduced over ranks, shape (O*I,)."""
        return self.comm.all_reduce(torch.where(support.mask, h, 0).sum(1).reshape(-1), "sum")


# --------------------------------------------------------------------------------------------------------------
# dense output / Jacobian given a support
# --------------------------------------------------------------------------------------------------------------


def project_output(z3: Tensor, tau: Tensor, support: Support) -> Tensor:
    """``max(z3 - tau, 0)`` as a new dense tensor."""
    O, n, I = z3.shape
    return (z3 - tau.view(O, 1, I)).clamp_(min=0)


def support_jvp(g3: Tensor, support: Support, proj: SimplexProjector) -> Tuple[Tensor, Tensor]:
    """Jacobian of the projection applied to ``g3``: ``g - mean_S(g)`` on the support, 0 elsewhere.

    Returns ``(grad (O, n, I), mean per slice)``; the mean is the gradient w.r.t. the scale.
    """
    O, n, I = g3.shape
    mean = proj.slice_sums(support, g3) / support.counts.clamp(min=1)
    return torch.where(support.mask, g3 - mean.view(O, 1, I), 0), mean


# --------------------------------------------------------------------------------------------------------------
# autograd Function
# --------------------------------------------------------------------------------------------------------------


def _view3(shape: Sequence[int], dim: int) -> Tuple[int, int, int]:
    O = math.prod(shape[:dim])
    return O, shape[dim], math.prod(shape[dim + 1:])


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, scale_k: Tensor, dim: int, k: int):
        cdt = compute_dtype(z.dtype)
        shp3 = _view3(z.shape, dim)
        z3 = z.detach().to(cdt).contiguous().view(shp3)
        kshape = list(z.shape)
        kshape[dim] = 1
        s_flat = scale_k.detach().to(cdt).expand(kshape).reshape(-1)
        proj = SimplexProjector(s_flat, k=k, exact=True)  # one call, not a training step: host reads are fine
        tau, sup = proj.threshold(z3)
        out = project_output(z3, tau, sup)
        ctx.kind = sup.kind
        ctx.shp3 = shp3
        ctx.kshape = kshape
        ctx.in_dtype = z.dtype
        ctx.scale_shape = scale_k.shape
        ctx.scale_dtype = scale_k.dtype
        ctx.save_for_backward(*sup.tensors())
        return out.view(z.shape).to(z.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        sup = Support(ctx.kind, *ctx.saved_tensors)
        counts = sup.counts
        g3 = g.to(counts.dtype).contiguous().view(ctx.shp3)
        gz, mean = support_jvp(g3, sup, SimplexProjector(counts))
        gz = gz.view(g.shape).to(ctx.in_dtype)
        gs = None
        if ctx.needs_input_grad[1]:
            gs = mean.view(ctx.kshape).sum_to_size(ctx.scale_shape).to(ctx.scale_dtype)
        return gz, gs, None, None


def _scale_keepdim(z: Tensor, scale: Union[float, Tensor], dim: int) -> Tensor:
    """``scale`` as a tensor broadcastable to ``z.shape`` with ``dim`` set to 1, validated (>= 0, finite)."""
    kshape = list(z.shape)
    kshape[dim] = 1
    if not isinstance(scale, Tensor):
        s = float(scale)
        if not (math.isfinite(s) and s >= 0):
            raise ValueError(f"sparsemax: scale must be a finite number >= 0, got {scale}")
        return torch.full((), s, dtype=compute_dtype(z.dtype), device=z.device)
    st = scale
    if st.dim() == z.dim() - 1 and z.dim() > 0:
        st = st.unsqueeze(dim)
    elif st.dim() not in (0, z.dim()):
        raise ValueError(
            f"sparsemax: scale of shape {tuple(scale.shape)} does not match input {tuple(z.shape)} with dim={dim}: "
            f"give one value per slice, shape {tuple(kshape)} or {tuple(z.shape[:dim] + z.shape[dim + 1:])}")
    try:
        torch.broadcast_shapes(st.shape, kshape)
        ok = list(torch.broadcast_shapes(st.shape, kshape)) == kshape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"sparsemax: scale of shape {tuple(scale.shape)} is not one value per slice of input "
            f"{tuple(z.shape)} along dim={dim} (expected broadcastable to {tuple(kshape)})")
    sd = st.detach()
    if sd.numel() and not bool(torch.isfinite(sd).all() and (sd >= 0).all()):
        bad = sd[~(torch.isfinite(sd) & (sd >= 0))].reshape(-1)[0].item()
        raise ValueError(f"sparsemax: scale must be finite and >= 0, got a value {bad}")
    return st


def sparsemax(z: Tensor, scale: Union[float, Tensor] = 1.0, dim: int = -1, k: int = 16) -> Tensor:
    """Euclidean projection of every slice of ``z`` along ``dim`` onto ``{p >= 0, sum p = scale}``.

    ``scale``: a float >= 0, or a tensor with one value per slice: broadcastable to ``z``'s shape with ``dim`` of
    size 1, or of ``z``'s shape without ``dim``. Any shape and float dtype (float64 is computed in float64, the
    others in float32; the result has ``z``'s dtype). Scale 0 gives zeros. Differentiable in ``z`` (closed form
    ``g - mean_S(g)`` on the support S, 0 elsewhere; only the support is saved) and in ``scale`` (``mean_S(g)``).
    ``k``: candidates per slice for the threshold search (affects speed only, never the result).
    Not checked (a full pass): NaN/inf in ``z``.
    """
    if not isinstance(z, Tensor):
        raise TypeError(f"sparsemax: z must be a tensor, got {type(z).__name__}")
    if z.dim() == 0:
        raise ValueError("sparsemax: z must have at least one dimension")
    dim = dim % z.dim()
    if z.shape[dim] == 0:
        if z.numel() == 0 and math.prod(z.shape[:dim] + z.shape[dim + 1:]) == 0:
            return z.clone()
        raise ValueError(f"sparsemax: slices along dim={dim} are empty (shape {tuple(z.shape)}): no projection")
    st = _scale_keepdim(z, scale, dim)
    if z.numel() == 0:
        return z.clone()
    return _Sparsemax.apply(z, st, dim, int(k))
