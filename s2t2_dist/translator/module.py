"""TokenTranslator: the trainable translation C -> P -> (E', L'), optionally column-sharded across ranks.

Shapes (see docs/DESIGN.md): C is v x u (source tokens x target tokens); rank r holds the columns
``[col_start, col_end)`` (:func:`~s2t2_dist.distributed.sharded_sinkhorn.shard_bounds`: the first ``u % R`` ranks get one
extra column). ``P = sinkhorn(C)`` has rows summing (approximately, after ``n_iter`` iterations) to ``mu`` and
columns summing exactly to ``nu``.

Normalisations (``E'[j] = sum_i W_E[i, j] E[src_ids[i]]``, ``L'[j] = sum_i W_L[i, j] L[src_ids[i]]``):

* ``"convex"`` (default): ``W_E = W_L = P / nu``; every column of W sums to one (exactly, since the last Dykstra
  step is the column projection), so E'_j and L'_j are convex combinations of source rows.
* ``"paper"``: the literal formulas of the paper, ``E' = (P^T (1/mu)) E`` i.e. ``W_E = P_ij / mu_i`` (columns do
  NOT sum to one in general) and ``L' = (P (1/nu))^T L`` i.e. ``W_L = P / nu``.

Gradient convention when sharded: :meth:`embed_and_head` returns the FULL E' and L' on every rank (all-gather of
the local rows); in backward the gradient reaching rank r's rows is the MEAN over ranks of their upstream
gradients. So the gradient on each C shard is the gradient of ``(1/R) sum_q loss_q``: equal to the single-process
gradient when every rank computes the same loss, and to the DDP-averaged gradient when each rank computes the loss
of its own micro-batch. Regularisers: add ``alpha * entropy_local()`` on every rank (its local share; no
collective; the shares sum to H over ranks and their gradients are not averaged), or ``alpha * entropy()`` (the
global H on every rank, mean convention); both give the objective ``mean_q ce_q + alpha * H``.
"""
from __future__ import annotations


import torch
import torch.nn as nn
from torch import Tensor

from s2t2_dist.distributed.sharded_sinkhorn import (
    GroupComm,
    all_reduce_sum_mean_grad,
    gather_rows_mean_grad,
    shard_bounds,
    world_of,
)
from s2t2_dist.ot.entropy import entropy as _entropy
from s2t2_dist.ot.marginals import safe_inv
from s2t2_dist.ot.sinkhorn import validate_plan_inputs
from s2t2_dist.translator.kinds import REGISTRY, Kind
from s2t2_dist.translator.product import plan_product

__all__ = ["TokenTranslator", "NORMALIZATIONS", "translated_rows", "translation_weights"]

NORMALIZATIONS = ("convex", "paper")


def _no_autocast(t: Tensor):
    """The translator computes in C's dtype (float32) even inside a bf16 autocast region: the Sinkhorn's marginals
    and P's small entries (about 1/v) are lost in bf16's 8 mantissa bits, and autocast would run P^T @ E in bf16."""
    return torch.autocast(t.device.type, enabled=False)


def translation_weights(P: Tensor, mu: Tensor, nu: Tensor, normalization: str, part: str = "head") -> Tensor:
    """W (v x u) of ``part``: ``W_L = P / nu``; ``W_E = P / nu`` ("convex") or ``P / mu`` ("paper"). Formed
    explicitly, for inspection; :func:`translated_rows` applies the same normalisation without forming it."""
    if part not in ("embed", "head"):
        raise ValueError(f"part must be 'embed' or 'head', got {part!r}")
    if normalization == "paper" and part == "embed":
        return P * safe_inv(mu).to(P.dtype).unsqueeze(1)
    return P * safe_inv(nu).to(P.dtype).unsqueeze(0)


def translated_rows(P: Tensor, E_src: Tensor, L_src: Tensor, mu: Tensor, nu: Tensor, normalization: str,
                    sparse: bool = False, product=plan_product) -> tuple[Tensor, Tensor]:
    """(E', L') = (W_E^T E_src, W_L^T L_src), u x d in P's dtype: the one definition of the translated embedding
    and head, for training (:meth:`TokenTranslator.embed_and_head`) and export (stages/init_model.py).

    ``P`` (v x u, or a column block with its ``nu``), ``E_src``/``L_src`` the v source rows (``L_src is E_src``:
    a tied model, computed once under "convex"), in any dtype (cast as read). W = P / nu and W = P / mu are never
    formed (v x u temporaries): the 1/nu scales the u x d result, the 1/mu the v x d source rows. The products are
    :func:`~s2t2_dist.translator.product.plan_product` (only P's live rows are read; ``product``: another
    ``(P, M, sparse) -> P^T M``, e.g. a dense GEMM to time against); ``sparse``: the sparse kind's plan (its gradient
    is read only on its support)."""
    inv_nu = safe_inv(nu).to(P.dtype).unsqueeze(1)
    L_new = product(P, L_src, sparse) * inv_nu
    if normalization == "convex":
        E_new = L_new if E_src is L_src else product(P, E_src, sparse) * inv_nu
    else:
        E_new = product(P, E_src.to(P.dtype) * safe_inv(mu).to(P.dtype).unsqueeze(1), sparse)
    return E_new, L_new


class TokenTranslator(nn.Module):
    """Trainable translation from ``v`` source tokens to ``u`` target tokens.

    Args:
        v, u: numbers of source and target tokens.
        kind: a name of translator/kinds.py's registry (how C becomes P).
        n_iter: Dykstra iterations (paper: 3).
        normalization: ``"convex"`` or ``"paper"`` (see module docstring).
        mu, nu: marginals (v), (u); uniform by default; see :meth:`from_frequencies`.
        group: a torch.distributed process group to shard the columns of C over (None: not sharded).
        floor: sparse only: weights W = P / nu below ``floor / v`` are dropped from P and each column rescaled
            to nu_j (0: off; see translator/kinds.py SparseKind.plan).
        dtype, device: of C (float32 by default).

    ``C`` (parameter, v x u_local) starts at ``1/v``. ``mu`` and ``nu`` (full) are buffers.
    """

    def __init__(
        self,
        v: int,
        u: int,
        *,
        kind: str = "sparse",
        n_iter: int = 3,
        normalization: str = "convex",
        mu: Tensor | None = None,
        nu: Tensor | None = None,
        group=None,
        dtype: torch.dtype = torch.float32,
        device=None,
        floor: float = 0.0,
    ):
        super().__init__()
        if kind not in REGISTRY:
            raise ValueError(f"kind must be one of {sorted(REGISTRY)}, got {kind!r}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        if n_iter < 1:
            raise ValueError(f"n_iter must be >= 1, got {n_iter}")
        if v < 1 or u < 1:
            raise ValueError(f"v and u must be >= 1, got v={v}, u={u}")
        self.v, self.u = int(v), int(u)
        if floor < 0:
            raise ValueError(f"floor must be >= 0, got {floor}")
        self.floor = float(floor)
        self.n_iter, self.normalization = int(n_iter), normalization
        self.group = group
        self.rank, self.world_size = world_of(group) if group is not None else (0, 1)
        if self.u < self.world_size:
            raise ValueError(f"u={u} target tokens cannot be column-sharded over {self.world_size} ranks "
                             "(every rank needs a column)")
        self.col_start, self.col_end = shard_bounds(self.u, self.world_size, self.rank)
        self.col_sizes = [b - a for a, b in (shard_bounds(self.u, self.world_size, r) for r in range(self.world_size))]
        mu = torch.full((self.v,), 1.0 / self.v, dtype=torch.float64) if mu is None else mu.detach()
        nu = torch.full((self.u,), 1.0 / self.u, dtype=torch.float64) if nu is None else nu.detach()
        validate_plan_inputs(torch.empty(self.v, self.u, device="meta"), mu.reshape(-1) if mu.dim() else mu,
                             nu.reshape(-1) if nu.dim() else nu, check_C=False)
        self.register_buffer("mu", mu.to(device=device, dtype=dtype).clone())
        self.register_buffer("nu", nu.to(device=device, dtype=dtype).clone())
        # the local columns of positive mass (None: all), found here on the host: the statistics of a logging step
        # select them without a device sync (nu, like mu, is fixed at construction)
        live = nu.detach().cpu().to(dtype)[self.col_start: self.col_end] > 0
        self.live_cols = None if bool(live.all()) else live.nonzero().reshape(-1)
        self.C = nn.Parameter(torch.full((self.v, self.col_end - self.col_start), 1.0 / self.v, dtype=dtype,
                                         device=device))
        if kind not in REGISTRY:
            raise ValueError(f"kind must be one of {sorted(REGISTRY)}, got {kind!r}")
        self._kind_name = kind
        self._plan_kind: Kind = REGISTRY[kind](self)
        self._comm = None
        self._cache_grad: tuple[int, Tensor] | None = None
        self._cache_val: tuple[int, Tensor] | None = None
        self._step = None  # begin_step's (outputs, leaves, inputs) until finish_step
        self._src_range = None  # (src_ids, its version, first id or None): see register_source_ids

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_frequencies(cls, source_counts: Tensor, target_counts: Tensor, smoothing: float = 0.0,
                         **kwargs) -> TokenTranslator:
        """Marginals from token counts: ``mu = (source_counts + smoothing) / sum``, same for ``nu``.

        A token with zero mass gets an all-zero row/column of P (its E'/L' row is then zero)."""
        sc = source_counts.detach().double().reshape(-1) + smoothing
        tc = target_counts.detach().double().reshape(-1) + smoothing
        for name, c in (("source_counts", sc), ("target_counts", tc)):
            if bool((c < 0).any()) or not bool(torch.isfinite(c).all()):
                raise ValueError(f"{name} must be finite and >= 0")
            if float(c.sum()) <= 0:
                raise ValueError(f"{name} sum to zero: no marginal")
        return cls(sc.numel(), tc.numel(), mu=sc / sc.sum(), nu=tc / tc.sum(), **kwargs)

    @torch.no_grad()
    def init_from_dense(self, P: Tensor) -> None:
        """Set C so that the plan starts at (approximately) the given full ``P`` (v x u), e.g. a transferred P.

        sparse: ``C = P`` (a feasible P is its own projection); softmax: ``C = log P`` (tiny floor);
        unconstrained: ``C = P / nu``."""
        if tuple(P.shape) != (self.v, self.u):
            raise ValueError(f"P must be {self.v} x {self.u}, got {tuple(P.shape)}")
        Pl = P[:, self.col_start: self.col_end].to(device=self.C.device, dtype=torch.float64)
        C = self.plan_kind.init_from_plan(Pl).to(self.C.dtype)
        if not bool(torch.isfinite(C).all()):  # the solvers run unchecked (kinds.py): C is checked where it is set
            raise ValueError("init_from_dense: P gives a non-finite C (P must be finite, and >= 0 for a plan)")
        self.C.copy_(C)
        self.invalidate()

    # ------------------------------------------------------------------ plumbing
    @property
    def kind(self) -> str:
        """The kind's name (fixed at construction: another kind is another translator, started from this one's P by
        :meth:`init_from_dense`)."""
        return self._kind_name

    @property
    def plan_kind(self) -> Kind:
        """The kind object (translator/kinds.py) that computes P from C."""
        return self._plan_kind

    @property
    def nu_local(self) -> Tensor:
        return self.nu[self.col_start: self.col_end]

    def shard_layout(self) -> dict:
        """{"C": [dim, start, end, total]}: this rank's columns of C, so that a checkpoint can be re-split over
        another number of ranks (engines/torch_engine.py reshard)."""
        return {"C": [1, self.col_start, self.col_end, self.u]}

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def comm(self) -> GroupComm:
        if self._comm is None:
            self._comm = GroupComm(self.group)
        return self._comm

    def _on_P_grad(self, g: Tensor) -> None:
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the cached P (values included): after backward the step's P is no longer needed, and a change of
        kind or of C made outside an optimiser step would otherwise go unseen."""
        self._cache_grad = None
        self._cache_val = None

    def _compute_P(self) -> Tensor:
        with _no_autocast(self.C):
            return self._compute_P_fp32()

    def _compute_P_fp32(self) -> Tensor:
        return self.plan_kind.plan(self.C)

    # ------------------------------------------------------------------ the plan
    def P(self) -> Tensor:
        """This rank's (v x u_local) block of P (the whole P when not sharded).

        Recomputed only when C has changed: within one step (same C, before backward) the same differentiable
        tensor is returned, e.g. to both :meth:`embed_and_head` and :meth:`entropy_local`. Under ``no_grad`` a
        detached cached value is returned while C is unchanged (e.g. for the several statistics of a report).
        Both caches are dropped when backward reaches P (a hook on that step's P; nothing is registered on C), so
        no copy of P is held between training steps."""
        ver = self.C._version
        if torch.is_grad_enabled() and self.C.requires_grad:
            if self._cache_grad is not None and self._cache_grad[0] == ver:
                return self._cache_grad[1]
            P = self._compute_P()
            self._cache_grad = (ver, P)
            self._cache_val = (ver, P.detach())
            if P.requires_grad:
                # backward reaching P: the step's P is no longer needed; free it before the Sinkhorn backward
                # allocates its own buffers (one v x u_local less at the peak)
                P.register_hook(self._on_P_grad)
            return P
        if self._cache_val is not None and self._cache_val[0] == ver:
            return self._cache_val[1]
        with torch.no_grad():
            P = self._compute_P()
        self._cache_val = (ver, P)
        return P

    def weights(self, P: Tensor | None = None, part: str = "embed") -> Tensor:
        """Normalised local weights W (v x u_local) of ``part`` in {"embed", "head"} (equal for "convex")."""
        return translation_weights(self.P() if P is None else P, self.mu, self.nu_local, self.normalization, part)

    def embed_and_head(self, E: Tensor, L: Tensor | None = None, src_ids: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
        """(E', L'), both u x d and FULL on every rank.

        ``E``, ``L``: the source model's embedding and head (frozen; ``L`` None or ``L is E`` for tied models);
        ``src_ids`` (v): the rows of E/L that are the v source tokens (e.g. OLMo's 50280 real tokens of its 50304
        padded rows); None: E has exactly v rows. Computed in float32 (or C's dtype), also inside a bf16 autocast
        region; cast as needed."""
        st = self._step
        if st is not None and st["inputs"] == (id(E), id(L), id(src_ids)):
            leaves = st["leaves"]
            return leaves[0], leaves[1]
        with _no_autocast(self.C):
            return self._embed_and_head(E, L, src_ids)

    # ------------------------------------------------------------------ one plan per optimiser step
    def begin_step(self, E: Tensor, L: Tensor | None = None, src_ids: Tensor | None = None,
                   entropy: bool = False) -> None:
        """Compute this step's E', L' (and, with ``entropy``, the global H(P)) ONCE for all its
        micro-batches: until :meth:`finish_step`, :meth:`embed_and_head` with the same arguments and
        :meth:`entropy` return detached leaf copies that accumulate their gradients over the micro-batches;
        :meth:`finish_step` then sends the accumulated gradients back through E', L' and the Sinkhorn into C in one
        backward. By linearity the gradient on C equals the sum of the per-micro-batch backwards. The source rows
        are cast to C's dtype once per step. Collective when sharded (every rank calls both)."""
        self._step = None
        self.invalidate()  # C changed since the last step: P, E', L' are this step's
        with _no_autocast(self.C):
            E_new, L_new = self._embed_and_head(E, L, src_ids)
        tied = L_new is E_new
        # the global H on every rank (one all-reduce of a scalar when sharded, mean-over-ranks gradient): a loss
        # term that, unlike this rank's share, does not depend on the number of ranks (logged losses, resumes)
        H = self._entropy_global() if entropy else None
        outs = [E_new, None if tied else L_new, H]  # E', L' (None: tied, L' is E'), H
        leaves = [None if o is None else o.detach().requires_grad_(o.requires_grad) for o in outs]
        if tied:
            leaves[1] = leaves[0]
        self._step = {"outs": outs, "leaves": leaves, "inputs": (id(E), id(L), id(src_ids))}

    def finish_step(self) -> None:
        """Backpropagate the step's accumulated gradients of E', L' (and H) into C, once; ends the step."""
        st, self._step = self._step, None
        if st is None:
            return
        outs, grads = [], []
        for o, leaf in zip(st["outs"], st["leaves"]):
            if o is None or not o.requires_grad:
                continue
            outs.append(o)
            # a missing gradient as zeros: every rank must run the same backward (the gather's is collective)
            grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(o))
        if outs:
            torch.autograd.backward(outs, grads)

    def _embed_and_head(self, E: Tensor, L: Tensor | None, src_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        tied = L is None or L is E
        L = E if L is None else L
        for name, M in (("E", E), ("L", L)):
            if M.dim() != 2:
                raise ValueError(f"{name} must be 2-D (tokens x d), got shape {tuple(M.shape)}")
        if src_ids is not None:
            if src_ids.dim() != 1 or src_ids.numel() != self.v:
                raise ValueError(f"src_ids must be 1-D with v={self.v} entries, got shape {tuple(src_ids.shape)}")
            E_src = self._source_rows(E, src_ids)
            L_src = E_src if tied else self._source_rows(L, src_ids)
        else:
            if E.shape[0] != self.v or L.shape[0] != self.v:
                raise ValueError(f"without src_ids E and L must have v={self.v} rows, got {E.shape[0]}, {L.shape[0]}")
            E_src, L_src = E, L
        if E_src.shape[1] != L_src.shape[1]:
            raise ValueError(f"E and L widths differ: {E_src.shape[1]} vs {L_src.shape[1]}")
        E_loc, L_loc = translated_rows(self.P(), E_src, L_src, self.mu, self.nu_local, self.normalization,
                                       sparse=self.plan_kind.sparse_product)
        if self.sharded:
            E_full = gather_rows_mean_grad(E_loc, self.col_sizes, self.comm())
            L_full = E_full if L_loc is E_loc else gather_rows_mean_grad(L_loc, self.col_sizes, self.comm())
            return E_full, L_full
        return E_loc, L_loc

    def register_source_ids(self, src_ids: Tensor) -> None:
        """Tell the translator the source ids it will be given (once, at setup: one host read). When they are one
        ascending run ``a, a+1, ...`` (the "all" source vocabulary), the source rows are then a view of E and L,
        not a copy of 50,280 x 2,048 rows per step (144 ms on CPU)."""
        first = None
        if src_ids.dim() == 1 and src_ids.numel():
            a = int(src_ids[0])
            run = torch.arange(a, a + src_ids.numel(), device=src_ids.device, dtype=src_ids.dtype)
            first = a if torch.equal(src_ids, run) else None
        self._src_range = (src_ids, src_ids._version, first)

    def _source_rows(self, M: Tensor, src_ids: Tensor) -> Tensor:
        """``M[src_ids]``: a view for the registered run of ids (:meth:`register_source_ids`), else a gather."""
        rng = self._src_range
        if (rng is not None and rng[0] is src_ids and rng[1] == src_ids._version and rng[2] is not None
                and rng[2] + src_ids.numel() <= M.shape[0]):
            return M.narrow(0, rng[2], src_ids.numel())
        return M.index_select(0, src_ids.to(M.device))

    def forward(self, E: Tensor, L: Tensor | None = None, src_ids: Tensor | None = None):
        return self.embed_and_head(E, L, src_ids)

    # ------------------------------------------------------------------ regulariser (statistics: stats.py)
    def entropy_local(self) -> Tensor:
        """This rank's share ``-sum_{local block} P log P`` (differentiable; the shares sum to H over ranks)."""
        if self._step is not None and torch.is_grad_enabled():
            raise RuntimeError("entropy_local inside a step: use entropy() (begin_step(..., entropy=True))")
        return _entropy(self.P())

    def entropy(self) -> Tensor:
        """H(P) of the global P on every rank (differentiable, mean-over-ranks gradient convention). Inside a step
        (:meth:`begin_step` with ``entropy=True``) the step's leaf copy, which accumulates its gradient."""
        if self._step is not None and torch.is_grad_enabled():
            if self._step["leaves"][2] is None:
                raise RuntimeError("entropy inside a step: call begin_step(..., entropy=True)")
            return self._step["leaves"][2]
        return self._entropy_global()

    def _entropy_global(self) -> Tensor:
        h = _entropy(self.P())
        return all_reduce_sum_mean_grad(h.reshape(1), self.comm()).reshape(()) if self.sharded else h

    # ------------------------------------------------------------------ export
    @torch.no_grad()
    def export_sparse(self, P: Tensor | None = None) -> dict[str, object]:
        """The local block as COO: ``indices`` (2 x nnz: row, LOCAL column), ``values``, ``col_offset`` (add it to
        get global columns), ``shape`` (v, u) and ``local_shape``."""
        P = self.P() if P is None else P.detach()
        idx = (P != 0).nonzero().t().contiguous()
        return {"indices": idx, "values": P[idx[0], idx[1]], "col_offset": self.col_start,
                "shape": (self.v, self.u), "local_shape": tuple(P.shape)}

    @torch.no_grad()
    def gather_sparse(self, P: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The global P as COO on every rank: (indices 2 x nnz with GLOBAL columns, values), row-major order."""
        ex = self.export_sparse(P)
        idx = ex["indices"].clone()
        idx[1] += self.col_start
        vals = ex["values"]
        if not self.sharded:
            return idx, vals
        c = self.comm()
        sizes = [int(s) for s in c.all_gather(torch.tensor([vals.numel()], device=vals.device)).reshape(-1)]
        all_idx = c.all_gather_rows(idx.t().contiguous(), sizes).t()
        all_vals = c.all_gather_rows(vals, sizes)
        order = (all_idx[0] * self.u + all_idx[1]).argsort()
        return all_idx[:, order].contiguous(), all_vals[order]

    def extra_repr(self) -> str:
        return (f"v={self.v}, u={self.u}, kind={self.kind}, n_iter={self.n_iter}, normalization={self.normalization}, "
                f"columns=[{self.col_start}, {self.col_end}) of {self.u} on rank {self.rank}/{self.world_size}")

