"""Scaled sparsemax: Euclidean projection onto {p >= 0, sum p = scale}, and its building blocks.

Pure math: no torch.distributed, no I/O. The distributed row projection (``s2t2_dist.dist``) reuses the same
building blocks by passing a ``comm`` object whose ``all_gather``/``all_reduce`` are collectives; here they are the
identity (:class:`LocalComm`).

Threshold algorithm (per slice ``z`` of length ``n``, scale ``s >= 0``): the projection is ``max(z - tau, 0)`` where
``tau`` is the unique root of ``sum_i max(z_i - tau, 0) = s``. For ``z`` sorted decreasingly and
``t_j = (z_(1) + ... + z_(j) - s) / j``, ``tau = max_j t_j`` (the sequence ``t_j`` is unimodal), so the threshold
``t`` of any top set of ``j`` elements is a LOWER bound of ``tau``.

1. Candidates: the top ``k`` values of each slice, found without a full sort by "block top-k": the maximum of every
   block of ``b`` consecutive elements (one streaming pass), the ``k`` best blocks per slice, then the top ``k`` among
   the ``k * b`` elements of those blocks. (Every element outside the chosen blocks is <= the k-th best block
   maximum, and the chosen blocks hold k elements >= it, so the top k of the chosen blocks is the top k of the slice.)
2. ``tau_k = max_{j <= k} t_j`` over the candidates. If the k-th candidate is <= ``tau_k``, every other element is
   too, so the support lies inside the candidates and ``tau_k`` is exact: no further pass over the slice.
3. Otherwise ("fallback" slices, e.g. everything at the paper's initialisation where all entries tie): start from
   ``max(tau_k, (sum z - s) / n)`` (both lower bounds; the second is exact when the support is everything, which
   ``min z > (sum z - s)/n`` verifies), then Michelot's fixed point ``tau <- (sum_{z > tau} z - s) / #{z > tau}``
   which from a lower bound increases monotonically to the exact ``tau`` and stops when the support count no longer
   changes (finitely many steps).

The support of every slice is returned as a :class:`Support` (``full``: every element; ``sparse``: flat indices;
``mask``: a bool tensor), which is all the backward pass needs: on the support ``S`` the Jacobian-vector product is
``g - mean_S(g)``, zero elsewhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "LocalComm",
    "Support",
    "SimplexProjector",
    "block_topk",
    "compute_dtype",
    "michelot_partials",
    "michelot_refine",
    "sparsemax",
    "threshold_from_sorted_candidates",
]

NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    if dtype == torch.float64:
        return torch.float64
    if not dtype.is_floating_point:
        raise TypeError(f"sparsemax needs a floating point tensor, got dtype {dtype}")
    return torch.float32


class LocalComm:
    """The single-process 'communicator': every collective is the identity.

    A distributed implementation (see ``s2t2_dist.dist.sharded_sinkhorn.GroupComm``) provides the same three
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


def michelot_partials(z: Tensor, tau: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """``(sum of z over z > tau, count of z > tau)`` along ``dim``; ``tau`` broadcasts against ``z`` (keepdim shape).

    Both are reduced locally; in the sharded row projection they are all-reduced (summed) over ranks before the
    Michelot update ``tau <- (sum - scale) / count``.
    """
    m = z > tau
    return torch.where(m, z, 0).sum(dim, dtype=torch.float64), m.sum(dim)


def michelot_refine(
    z: Tensor,
    tau: Tensor,
    scale: Tensor,
    dim: int,
    prev_count: Optional[Tensor] = None,
    comm=None,
    max_iter: int = 100_000,
) -> Tuple[Tensor, Tensor]:
    """Exact threshold by Michelot's fixed point from a LOWER bound ``tau`` (float64, one per slice).

    ``z`` is 2-D with slices along ``dim`` (0 or 1); ``scale`` one value per slice. ``prev_count`` is the size of
    the set whose threshold ``tau`` is (``None``: unknown), which lets the first step stop at once when that set is
    already the support. ``comm.all_reduce`` combines the per-rank partials (sharded slices). Returns
    ``(tau float64, count int64)``; each step is one pass over the slices that have not converged yet.
    """
    comm = comm or LocalComm()
    tau = tau.double().clone()
    scale = scale.double()
    nslice = tau.numel()
    count = torch.zeros(nslice, dtype=torch.int64, device=z.device)
    prev = prev_count.clone().long() if prev_count is not None else torch.full_like(count, -1)
    active = torch.arange(nslice, device=z.device)
    za = z
    for _ in range(max_iter):
        if active.numel() == 0:
            return tau, count
        t = tau[active].to(z.dtype)
        t = t.unsqueeze(dim)
        ssum, cnt = michelot_partials(za, t, dim)
        red = comm.all_reduce(torch.stack([ssum.double(), cnt.double()]), "sum")
        ssum, cnt = red[0], red[1].long()
        done = cnt == prev[active]
        new = ((ssum - scale[active]) / cnt.clamp(min=1)).maximum(tau[active])
        count[active] = cnt
        keep = ~done
        if not bool(keep.any()):
            return tau, count
        tau[active[keep]] = new[keep]
        prev[active[keep]] = cnt[keep]
        if bool(done.any()):
            # compact the not-yet-converged slices (one copy of the remaining ones)
            sel = keep.nonzero().squeeze(1)
            za = za.index_select(dim ^ 1, sel)
            active = active[keep]
    raise RuntimeError(f"michelot_refine did not converge in {max_iter} steps")


def _gather(t: Tensor, idx: Tensor) -> Tensor:
    """``t.reshape(-1)[idx]`` for a contiguous ``t`` (index_select on the flat view is several times faster)."""
    return t.reshape(-1).index_select(0, idx.reshape(-1)).view(idx.shape)


def _pad_rows(t: Tensor, rows: int, value) -> Tensor:
    """``t`` (r, S) padded with ``value`` to ``rows`` rows (unchanged if it already has that many or more)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, torch.full((rows - t.shape[0], t.shape[1]), value, dtype=t.dtype, device=t.device)])


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _choose_block(n: int, k: int) -> int:
    b = 2 ** int(round(math.log2(max(math.sqrt(n / max(k, 1)), 1.0))))
    return int(min(max(b, 2), 256))


def block_topk(z3: Tensor, k: int, block: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Top ``k`` values of every slice of ``z3`` (shape (O, n, I), slices along dim 1), sorted decreasingly.

    Returns ``(values, flat_index)``, both (k, O*I): column ``s = o*I + i`` is slice (o, i) and ``flat_index`` indexes
    the contiguous ``z3.reshape(-1)``. Exact (ties may pick any of the tied elements). Uses block maxima to avoid a
    top-k over whole slices when that is cheaper (see module docstring).
    """
    O, n, I = z3.shape
    S = O * I
    if not 1 <= k <= n:
        raise ValueError(f"block_topk: k={k} must be in [1, n={n}]")
    dev = z3.device
    o_of = torch.arange(O, device=dev).repeat_interleave(I)  # (S,)
    i_of = torch.arange(I, device=dev).repeat(O)
    b = block if block is not None else _choose_block(n, k)
    nb = n // b
    if b < 2 or nb <= k or n <= 64:
        vals, pos = z3.topk(k, dim=1)  # (O, k, I)
        vals = vals.permute(1, 0, 2).reshape(k, S)
        pos = pos.permute(1, 0, 2).reshape(k, S)
        return vals, (o_of * n + pos) * I + i_of
    main = nb * b
    bm = z3[:, :main, :].reshape(O, nb, b, I).amax(2)  # (O, nb, I): one streaming pass
    if main < n:
        bm = torch.cat([bm, z3[:, main:, :].amax(1, keepdim=True)], 1)
    nbt = bm.shape[1]
    bm = bm.permute(1, 0, 2).reshape(nbt, S)
    _, bi = bm.topk(k, dim=0)  # (k, S) best blocks
    rows = (bi.unsqueeze(1) * b + torch.arange(b, device=dev).view(1, b, 1)).reshape(k * b, S)
    valid = rows < n
    rows = rows.clamp(max=n - 1)
    fidx = (o_of * n + rows) * I + i_of
    cv = _gather(z3, fidx)
    if not bool(valid.all()):
        cv = cv.masked_fill(~valid, NEG_INF)
    vals, ti = cv.topk(k, dim=0)
    return vals, torch.gather(fidx, 0, ti)


@dataclass
class Support:
    """Support (positions with output > 0) of every slice of a simplex projection.

    kind:
      ``"full"``   every element of every slice;
      ``"sparse"`` ``idx``: flat int64 indices into the contiguous (O, n, I) tensor, ``sid``: slice id of each;
      ``"mixed"``  slices with ``full[s]`` are entirely in the support, the others are given by ``idx``/``sid``;
      ``"mask"``   ``mask``: bool (O, n, I).
    ``counts``: support size per slice (float, compute dtype; sharded slices count every rank).
    """

    kind: str
    counts: Tensor
    idx: Optional[Tensor] = None
    sid: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    full: Optional[Tensor] = None

    def tensors(self):
        return [self.counts, self.idx, self.sid, self.mask, self.full]

    def nnz(self) -> int:
        return int(self.counts.sum())


def _slices_2d(z3: Tensor, sel: Optional[Tensor]) -> Tuple[Tensor, int]:
    """The slices ``sel`` (None: all) of ``z3`` as a 2-D tensor, and the dim along which the slices run."""
    O, n, I = z3.shape
    if I == 1:
        z2 = z3.view(O, n)
        return (z2 if sel is None else z2.index_select(0, sel)), 1
    if O == 1:
        z2 = z3.view(n, I)
        return (z2 if sel is None else z2.index_select(1, sel)), 0
    z2 = z3.permute(1, 0, 2).reshape(n, O * I)
    return (z2 if sel is None else z2.index_select(1, sel)), 0


def _as3(z2: Tensor, rd: int) -> Tensor:
    """2-D slices (from :func:`_slices_2d`) as an (O, n, I) view."""
    return z2.unsqueeze(2) if rd == 1 else z2.unsqueeze(0)


def _flat_to_orig(fidx: Tensor, shp3c: Tuple[int, int, int], sel: Tensor, shp3: Tuple[int, int, int]) -> Tuple[Tensor, Tensor]:
    """Map flat indices of a compacted (f, n, 1) or (1, n, f) tensor of the slices ``sel`` back to ``shp3``.

    Returns (original flat indices, original slice ids)."""
    Oc, n, Ic = shp3c
    _, _, I = shp3
    if Ic == 1:
        r, pos = fidx // n, fidx % n
    else:
        pos, r = fidx // Ic, fidx % Ic
    s = sel[r]
    return ((s // I) * n + pos) * I + s % I, s


@dataclass
class _ThresholdState:
    """One threshold call's per-slice working state (S slices)."""

    tau64: Tensor  # thresholds, float64: lower bounds until the slice is resolved
    counts: Tensor  # support sizes
    covered: Tensor  # bool: the candidates held the whole support, so tau64 is exact
    cand_vals: Tensor  # (K, S) local candidate values, sorted decreasingly
    cand_idx: Tensor  # (K, S) their flat positions in z3 (-1: none)
    support_pieces: list = field(default_factory=list)  # (flat positions, slice ids) of support elements found
    needs_extraction: Optional[Tensor] = None  # slices whose support a pass over z3 must extract (Michelot)
    second_round: Optional[Tuple[Tensor, Tensor]] = None  # (slices, candidate positions): next call's warm start


class SimplexProjector:
    """Projection of every slice of a tensor onto the scaled simplex, split into reusable steps.

    ``scale``: one value per slice (flat, length O*I). ``n_total``: slice length over all ranks (``None``: the local
    length). ``k``: top candidates per slice and rank. ``comm``: :class:`LocalComm` or a distributed equivalent
    (slices split across ranks along their length; every decision is taken on reduced, hence identical, values so
    all ranks run the same collectives). ``sparse_density``: supports of the non-full slices with at most this
    fraction of non-zeros are stored as indices, otherwise as a bool mask.

    ``threshold(z3) -> (tau, support)`` does not modify ``z3``; ``slice_sums`` (backward) reduces per-slice sums over
    the support across ranks. ``stats`` records what the last call did (for benchmarks).
    """

    def __init__(self, scale: Tensor, n_total: Optional[int] = None, k: int = 16, block: Optional[int] = None,
                 comm=None, sparse_density: float = 1.0 / 16, max_k2: Optional[int] = None):
        self.scale = scale.reshape(-1)
        self.n_total = n_total
        self.k = int(k)
        self.block = block
        self.comm = comm or LocalComm()
        self.sparse_density = sparse_density
        self.max_k2 = max_k2
        self.stats = {}
        self._k = self.k  # adapted after every call to cover the largest non-full support seen
        self._full_first = False  # set when most slices had full support in the last call
        self._guess: Optional[Tensor] = None  # candidate positions of the last call (warm start)
        self._guess_shape = None
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {k}")

    # ------------------------------------------------------------------ candidates (steps 1-2)
    def _cold_candidates(self, z3: Tensor, k: int) -> Tuple[Tensor, Tensor, Tensor]:
        """Local top-k of every slice: (values sorted decreasingly (n_local, S), flat idx, value bounding the rest)."""
        O, n, I = z3.shape
        S = O * I
        cdt, dev = z3.dtype, z3.device
        n_local = min(k, n)
        if n_local > 0:
            vals, fidx = block_topk(z3, n_local, self.block)
            rest = vals[n_local - 1] if n > n_local else torch.full((S,), NEG_INF, dtype=cdt, device=dev)
            return vals, fidx, rest
        return (torch.empty(0, S, dtype=cdt, device=dev), torch.empty(0, S, dtype=torch.int64, device=dev),
                torch.full((S,), NEG_INF, dtype=cdt, device=dev))

    @staticmethod
    def _guess_candidates(z3: Tensor, guess: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Candidates at remembered positions ``guess`` (kg, S) (-1: none): (sorted values, flat idx, max of the
        other elements). One masked max pass: ``z3`` is modified and restored bit-exactly (our own buffer only)."""
        O, n, I = z3.shape
        S = O * I
        zf = z3.view(-1)
        valid = guess >= 0
        gv = torch.where(valid, _gather(zf, guess.clamp(min=0)), NEG_INF)
        if n == 0:
            rest = torch.full((S,), NEG_INF, dtype=z3.dtype, device=z3.device)
        else:
            gflat = guess[valid]
            zf.index_fill_(0, gflat, NEG_INF)
            rest = z3.amax(1).reshape(-1)
            zf.index_copy_(0, gflat, gv[valid])
        vals, order = gv.sort(dim=0, descending=True)
        return vals, torch.where(valid, guess, -1).gather(0, order), rest

    def _combine(self, vals: Tensor, rest: Tensor, n_cand: int, scale64: Tensor):
        """Thresholds from local candidates of every rank: (tau64, counts, covered).

        ``vals`` (n_local <= n_cand, S) sorted local candidates, ``rest`` bounds every local non-candidate. ``tau`` is
        a lower bound, exact (``covered``) when every non-candidate on every rank is <= it."""
        S = vals.shape[1]
        cdt, dev = vals.dtype, vals.device
        n_local = vals.shape[0]
        vals_p = vals if n_local == n_cand else torch.cat(
            [vals, torch.full((n_cand - n_local, S), NEG_INF, dtype=cdt, device=dev)])
        if self.comm.world_size > 1:
            g = self.comm.all_gather(torch.cat([vals_p, rest.unsqueeze(0)]))  # (R, n_cand+1, S)
            cand = g[:, :n_cand].reshape(-1, S).sort(dim=0, descending=True).values
            rest = g[:, n_cand].amax(0)
        else:
            cand = vals_p
        tau64, _ = threshold_from_sorted_candidates(cand, scale64, dim=0, with_count=False)
        tau = tau64.to(cdt)
        return tau64, (cand > tau).sum(0), rest <= tau

    def _candidates(self, z3: Tensor, k: int, scale64: Tensor, n_total: int):
        """Cold top-k candidates (all ranks): (tau64, counts, covered, local values, local flat idx)."""
        n_cand = min(k, n_total)
        vals, fidx, rest = self._cold_candidates(z3, n_cand)
        return (*self._combine(vals, rest, n_cand, scale64), vals, fidx)

    # ------------------------------------------------------------------ forward
    def _sums_mins(self, z3: Tensor, sel: Optional[Tensor], n_total: int, scale64: Tensor):
        """``(sum - scale) / n_total`` (float64, the threshold if the support is everything) and whether the
        support IS everything (``min > that``), for the slices ``sel`` (None: all), over all ranks."""
        S = z3.shape[0] * z3.shape[2]
        f = S if sel is None else sel.numel()
        if z3.shape[1] == 0:
            sums = torch.zeros(f, dtype=z3.dtype, device=z3.device)
            mins = torch.full((f,), float("inf"), dtype=z3.dtype, device=z3.device)
        elif sel is None or f * 4 > S:  # reduce every slice rather than copy many of them
            z2, rd = _slices_2d(z3, None)
            sums, mins = z2.sum(rd), z2.amin(rd)
            if sel is not None:
                sums, mins = sums[sel], mins[sel]
        else:
            z2, rd = _slices_2d(z3, sel)
            sums, mins = z2.sum(rd), z2.amin(rd)
        sums = self.comm.all_reduce(sums.double(), "sum")
        mins = self.comm.all_reduce(mins, "min")
        sc = scale64 if sel is None else scale64[sel]
        tfull = (sums - sc) / n_total
        return tfull, mins > tfull.to(z3.dtype)

    def threshold(self, z3: Tensor, inplace_ok: bool = False) -> Tuple[Tensor, Support]:
        """Exact thresholds ``tau`` (one per slice, compute dtype) and the support of ``max(z3 - tau, 0)``.

        ``inplace_ok``: ``z3`` is a private buffer that may be modified temporarily (restored bit-exactly), which
        allows warm-starting from the candidate positions of the previous call (one masked max pass instead of a
        top-k when the support has not left them).

        Phases (the module docstring's steps): test full support first when it was common last time; candidate
        thresholds (warm or cold, step 1-2); exact thresholds of the slices whose support is everything; a second
        candidate round or Michelot for the slices still unresolved (step 3); the support; adapting k and the warm
        start for the next call.
        """
        O, n, I = z3.shape
        n_slices = O * I
        dev = z3.device
        n_total = self.n_total if self.n_total is not None else n
        scale = self.scale.to(device=dev, dtype=torch.float64)
        if scale.numel() != n_slices:
            raise ValueError(f"scale has {scale.numel()} values for {n_slices} slices")
        self.stats = {"slices": n_slices, "k": self._k, "full_first": self._full_first, "warm": False,
                      "uncovered": 0, "full": 0, "second_round": 0, "michelot": 0}
        full_first = None
        if self._full_first:  # most slices had full support last time (e.g. the paper's init): test that first
            full_first = self._sums_mins(z3, None, n_total, scale)
            full_threshold, is_full = full_first
            if bool(is_full.all()):
                self.stats["full"] = n_slices
                return full_threshold.to(z3.dtype), Support(
                    "full", torch.full((n_slices,), float(n_total), dtype=z3.dtype, device=dev))
        state = self._candidate_thresholds(z3, inplace_ok, full_first, scale, n_total)
        unresolved, full_bound = self._settle_full_support(z3, state, full_first, scale, n_total)
        if unresolved.numel():
            self._refine_unresolved(z3, state, unresolved, full_bound, scale, n_total)
        tau = state.tau64.to(z3.dtype)
        full = state.counts == n_total
        support = self._build_support(z3, tau, state.counts, state.counts.to(z3.dtype), full, int(full.sum()),
                                      state.covered, state.cand_vals, state.cand_idx, state.support_pieces,
                                      state.needs_extraction)
        self._adapt_for_next_call(z3, state, support, full, n_total, inplace_ok)
        return tau, support

    def _candidate_thresholds(self, z3: Tensor, inplace_ok: bool, full_first, scale: Tensor,
                              n_total: int) -> "_ThresholdState":
        """Candidate thresholds of every slice: from the last call's candidate positions when allowed (cold top-k
        for the few slices they miss), else cold top-k candidates."""
        shp3 = tuple(z3.shape)
        n_slices = shp3[0] * shp3[2]
        warm = self._guess if (inplace_ok and self._guess is not None and self._guess_shape == shp3) else None
        if warm is None:
            return _ThresholdState(*self._candidates(z3, self._k, scale, n_total))
        self.stats["warm"] = True
        already_full = full_first[1] if full_first is not None else torch.zeros(n_slices, dtype=torch.bool,
                                                                                  device=z3.device)
        n_warm = warm.shape[0]
        vals, fidx, rest = self._guess_candidates(z3, warm)
        tau64, counts, covered = self._combine(vals, rest, n_warm, scale)
        missed = (~covered & ~already_full).nonzero().squeeze(1)
        if missed.numel() * 4 > n_slices:  # the warm start missed too many slices: cold candidates for all
            return _ThresholdState(*self._candidates(z3, self._k, scale, n_total))
        if missed.numel():  # cold candidates for the few slices the warm start missed
            z_missed, rd = _slices_2d(z3, missed)
            z_missed3 = _as3(z_missed, rd)
            t_m, c_m, cov_m, v_m, f_m = self._candidates(z_missed3, self._k, scale[missed], n_total)
            if f_m.numel():
                f_m = _flat_to_orig(f_m, tuple(z_missed3.shape), missed, shp3)[0]
            n_rows = max(n_warm, v_m.shape[0])
            vals = _pad_rows(vals, n_rows, NEG_INF)
            fidx = _pad_rows(fidx, n_rows, -1)
            vals[:, missed] = _pad_rows(v_m, n_rows, NEG_INF)
            fidx[:, missed] = _pad_rows(f_m.view(v_m.shape), n_rows, -1)
            tau64[missed], counts[missed], covered[missed] = t_m, c_m, cov_m
        return _ThresholdState(tau64, counts, covered, vals, fidx)

    def _settle_full_support(self, z3: Tensor, state: "_ThresholdState", full_first, scale: Tensor,
                             n_total: int) -> Tuple[Tensor, Tensor]:
        """Exact thresholds of the uncovered slices whose support is everything; returns the slices still
        unresolved and, for each, the threshold its support would have if it were everything (a lower bound)."""
        if full_first is not None:
            full_threshold, is_full = full_first
            state.tau64 = torch.where(is_full, full_threshold, state.tau64)
            state.counts = torch.where(is_full, torch.full_like(state.counts, n_total), state.counts)
            uncovered = (~state.covered & ~is_full).nonzero().squeeze(1)
            self.stats["full"] = int(is_full.sum())
            self.stats["uncovered"] = int(uncovered.numel())
            return uncovered, full_threshold[uncovered]
        uncovered = (~state.covered).nonzero().squeeze(1)
        self.stats["uncovered"] = int(uncovered.numel())
        if not uncovered.numel():
            return uncovered, uncovered.new_empty(0, dtype=torch.float64)
        full_threshold, is_full = self._sums_mins(z3, uncovered, n_total, scale)
        state.tau64[uncovered] = torch.where(is_full, full_threshold, state.tau64[uncovered])
        state.counts[uncovered] = torch.where(is_full, torch.full_like(state.counts[uncovered], n_total),
                                           state.counts[uncovered])
        self.stats["full"] = int(is_full.sum())
        return uncovered[~is_full], full_threshold[~is_full]

    def _refine_unresolved(self, z3: Tensor, state: "_ThresholdState", unresolved: Tensor, full_bound: Tensor,
                           scale: Tensor, n_total: int) -> None:
        """Exact thresholds of the unresolved slices from the best lower bound: a second candidate round when the
        elements above that bound are few, else Michelot's fixed point (step 3)."""
        cdt = z3.dtype
        shp3 = tuple(z3.shape)
        lower = torch.maximum(state.tau64[unresolved], full_bound)
        # size of the set whose threshold `lower` is (n_total if the full-support bound won, unknown otherwise)
        lower_count = torch.where(full_bound >= state.tau64[unresolved], n_total, -1).long()
        z_u, rd = _slices_2d(z3, unresolved)
        _, above = michelot_partials(z_u, lower.to(cdt).unsqueeze(rd), rd)
        above = self.comm.all_reduce(above.double(), "sum").long()
        most_above = int(above.max())
        z_u3 = _as3(z_u, rd)
        if most_above >= self._k_cap(n_total):
            self.stats["michelot"] = int(unresolved.numel())
            state.tau64[unresolved], state.counts[unresolved] = michelot_refine(z_u, lower, scale[unresolved], rd,
                                                                          lower_count, self.comm)
            state.needs_extraction = unresolved
            return
        # second round: the top most_above + 1 candidates contain {z > lower} (a superset of the support) and one
        # element <= lower <= tau, so the candidate threshold is exact (covered)
        self.stats["second_round"] = int(unresolved.numel())
        tau2, counts2, covered2, vals2, fidx2 = self._candidates(z_u3, most_above + 1, scale[unresolved], n_total)
        state.tau64[unresolved] = tau2
        state.counts[unresolved] = counts2
        if vals2.numel():
            positions = _flat_to_orig(fidx2, tuple(z_u3.shape), unresolved, shp3)[0]
            state.second_round = (unresolved, positions)
            if covered2.numel():
                above_tau = vals2[:, covered2] > tau2[covered2].to(cdt)
                slice_id = unresolved[covered2].unsqueeze(0).expand_as(above_tau)
                state.support_pieces.append((positions[:, covered2][above_tau], slice_id[above_tau]))
        rounding_misses = (~covered2).nonzero().squeeze(1)  # only through rounding; finish exactly
        if rounding_misses.numel():
            z_b, rd_b = _slices_2d(z_u3, rounding_misses)
            slices = unresolved[rounding_misses]
            state.tau64[slices], state.counts[slices] = michelot_refine(z_b, tau2[rounding_misses],
                                                                  scale[unresolved][rounding_misses], rd_b, None,
                                                                  self.comm)
            state.needs_extraction = slices

    def _adapt_for_next_call(self, z3: Tensor, state: "_ThresholdState", support: Support, full: Tensor,
                             n_total: int, inplace_ok: bool) -> None:
        """k (candidates per slice) and the warm-start positions for the next call; decisions on reduced values,
        so identical on every rank."""
        n_slices = full.numel()
        n_full = int(full.sum())
        self._full_first = n_full * 4 > n_slices
        if n_full == n_slices:
            need = 0
        elif support.kind in ("sparse", "mixed") and self.comm.world_size > 1:
            # candidates needed per RANK: the largest local support of a non-full slice, over all ranks
            local = (torch.bincount(support.sid, minlength=n_slices)[~full].max() if support.sid.numel()
                     else state.counts.new_zeros(()))
            need = int(self.comm.all_reduce(local.reshape(1).double(), "max"))
        else:
            need = int(state.counts[~full].max())
        self._k = min(max(self.k, _next_pow2(need + need // 4 + 1)), max(self.k, self._k_cap(n_total)))
        if inplace_ok:
            guess = _pad_rows(state.cand_idx, self._k, -1)[: self._k]
            if state.second_round is not None:
                slices, positions = state.second_round
                guess = guess.clone()
                guess[:, slices] = _pad_rows(positions, self._k, -1)[: self._k]
            self._guess, self._guess_shape = guess, tuple(z3.shape)

    def _build_support(self, z3, tau, counts, counts_f, full, nfull, covered, vals, fidx, pieces, need_extract):
        O, n, I = z3.shape
        S = O * I
        dev = z3.device
        n_total = self.n_total if self.n_total is not None else n
        if nfull == S:
            return Support("full", counts_f)
        nonfull_nnz = float(counts[~full].sum()) * n / max(n_total, 1)
        if nonfull_nnz > self.sparse_density * z3.numel():
            return Support("mask", counts_f, mask=z3 > tau.view(O, 1, I))
        # sparse pieces: covered non-full slices from the first candidates
        c_nf = (covered & ~full).nonzero().squeeze(1)
        if c_nf.numel() and vals.numel():
            m = vals[:, c_nf] > tau[c_nf]
            sid = c_nf.unsqueeze(0).expand_as(m)
            pieces.insert(0, (fidx[:, c_nf][m], sid[m]))
        if need_extract is not None:
            ne = need_extract[~full[need_extract]]
            if ne.numel():
                ze, rde = _slices_2d(z3, ne)
                nz = (ze > tau[ne].unsqueeze(rde)).nonzero()
                r, pos = (nz[:, 0], nz[:, 1]) if rde == 1 else (nz[:, 1], nz[:, 0])
                s_ = ne[r]
                pieces.append((((s_ // I) * n + pos) * I + s_ % I, s_))
        if pieces:
            idx = torch.cat([p[0] for p in pieces])
            sid = torch.cat([p[1] for p in pieces])
            # canonical order: the support (and every later sum over it) does not depend on which candidate path
            # found it, so warm and cold starts give bit-identical results
            idx, order = idx.sort()
            sid = sid.index_select(0, order)
        else:
            idx = torch.empty(0, dtype=torch.int64, device=dev)
            sid = torch.empty(0, dtype=torch.int64, device=dev)
        if nfull:
            return Support("mixed", counts_f, idx, sid, full=full)
        return Support("sparse", counts_f, idx, sid)

    def _k_cap(self, n_total: int) -> int:
        if self.max_k2 is not None:
            return self.max_k2
        return max(4 * self.k, min(1024, n_total // 8))

    # ------------------------------------------------------------------ backward helper
    def slice_sums(self, shp3: Tuple[int, int, int], support: Support, h: Optional[Tensor] = None,
                   hvals: Optional[Tensor] = None, dense_sums: Optional[Tensor] = None) -> Tensor:
        """Per-slice sums over the support, reduced over ranks, shape (O*I,).

        ``h``: dense (O, n, I) values; or ``hvals`` (values at ``support.idx``) plus, for a mixed support,
        ``dense_sums`` (per-slice sums over whole slices, used for the full slices).
        """
        O, n, I = shp3
        kind = support.kind
        if kind in ("sparse", "mixed"):
            if hvals is None:
                hvals = _gather(h, support.idx)
            s = torch.zeros(O * I, dtype=hvals.dtype, device=hvals.device).index_add_(0, support.sid, hvals)
            if kind == "mixed":
                if dense_sums is None:
                    dense_sums = h.sum(1).reshape(-1)
                s = torch.where(support.full, dense_sums, s)
        elif kind == "full":
            s = h.sum(1).reshape(-1) if dense_sums is None else dense_sums
        else:
            s = torch.where(support.mask, h, 0).sum(1).reshape(-1)
        return self.comm.all_reduce(s, "sum")


# --------------------------------------------------------------------------------------------------------------
# dense output / Jacobian given a support
# --------------------------------------------------------------------------------------------------------------


def project_output(z3: Tensor, tau: Tensor, support: Support) -> Tensor:
    """``max(z3 - tau, 0)`` as a new dense tensor, using the support to skip work where possible."""
    O, n, I = z3.shape
    t = tau.view(O, 1, I)
    kind = support.kind
    if kind == "full":
        return z3 - t
    if kind == "mask":
        return (z3 - t).clamp_(min=0)
    if kind == "sparse":
        out = torch.zeros_like(z3)
    else:
        f = support.full.to(z3.dtype).view(O, 1, I)
        out = torch.addcmul(-t * f, z3, f)
    vals = _gather(z3, support.idx) - tau.index_select(0, support.sid)
    out.view(-1).index_copy_(0, support.idx, vals)
    return out


def support_jvp(g3: Tensor, support: Support, proj: SimplexProjector) -> Tuple[Tensor, Tensor]:
    """Jacobian of the projection applied to ``g3``: ``g - mean_S(g)`` on the support, 0 elsewhere.

    Returns ``(grad (O, n, I), mean per slice)``; the mean is the gradient w.r.t. the scale.
    """
    O, n, I = g3.shape
    sums = proj.slice_sums(g3.shape, support, h=g3)
    mean = sums / support.counts.clamp(min=1)
    m = mean.view(O, 1, I)
    kind = support.kind
    if kind == "full":
        return g3 - m, mean
    if kind == "mask":
        return torch.where(support.mask, g3 - m, 0), mean
    if kind == "sparse":
        out = torch.zeros_like(g3)
    else:
        f = support.full.to(g3.dtype).view(O, 1, I)
        out = torch.addcmul(-m * f, g3, f)
    vals = _gather(g3, support.idx) - mean.index_select(0, support.sid)
    out.view(-1).index_copy_(0, support.idx, vals)
    return out, mean


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
        proj = SimplexProjector(s_flat, k=k)
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
