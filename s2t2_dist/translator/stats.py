"""P's statistics in one home: the training translator's (logged as P/... and C/..., and result.json's
sparsity at the start and the end) and a P file's (`SparseP.stats`: the demo's and the reproduction's reports).

Statistics come in two halves: ``add_*`` registers this rank's partial values (pure math on its block of P, on the
device, no host read) into a StatsBatch and returns the function that finishes them from the reduced host values;
the training loop reduces one batch per logging step (the loop's numbers, every statistic and the gradient monitor
in ONE collective and one read). The plain methods (density_stats, ...) reduce a batch of their own.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from s2t2_dist.distributed.stats_batch import Reduced, StatsBatch
from s2t2_dist.ot.entropy import entropy as _entropy
from s2t2_dist.ot.marginals import safe_inv

#: a step counts as frozen when fewer than this fraction of the target columns receive any gradient on C
FREEZE_LIVE_COLS = 0.05


def sparsity_summary(row_nnz, col_nnz, col_max_weight: torch.Tensor | None = None,
                     col_entropy: torch.Tensor | None = None) -> dict:
    """P's sparsity statistics from its non-zeros per source row (v) and per target column (u), for the training
    translator (:meth:`PStats.add_density`) and P files (:func:`file_stats`). The counts may be tensors or numpy
    arrays: they are summarised on the host with numpy (the training translator hands over the host copy of its one
    fused read; a torch op there would look like a device sync to utils/syncs.py), exactly (integers).

    Mass-based sparsity, when given the largest weight and the entropy (nats) of each live column of W = P / nu:
    ``max_weight_mean`` (1.0: every target token reads one source token) and ``col_entropy_mean`` (0: one source
    each; log v: uniform). Non-zero counts alone call a column with 99% of its mass on one entry dense."""
    rows, cols = _host_ints(row_nnz), _host_ints(col_nnz)
    v, u = rows.size, cols.size
    nnz = int(rows.sum())
    mass = {}
    if col_max_weight is not None and col_entropy is not None:
        n = max(col_max_weight.numel(), 1)
        mass = {"max_weight_mean": float(col_max_weight.double().sum()) / n,
                "col_entropy_mean": float(col_entropy.double().sum()) / n}
    # integer sums are exact, so sum / n is what torch's float64 mean gave
    return {**mass,
        "nnz": nnz,
        "density": nnz / float(v * u),
        "row_nnz_mean": nnz / v,
        "row_nnz_max": float(rows.max()),
        "rows_empty": float((rows == 0).sum()),
        "col_nnz_mean": int(cols.sum()) / u,
        "col_nnz_min": float(cols.min()),
        "col_nnz_max": float(cols.max()),
    }


def _host_ints(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(np.int64, copy=False).reshape(-1)


def file_stats(indices: Tensor, values: Tensor, nu: Tensor, shape: tuple[int, int]) -> dict:
    """The statistics of a P given as COO (a P file): sparsity (:func:`sparsity_summary`, with the mass-based part
    from the non-zeros only: no v x u temporary), entropy H(P) (None for a signed P, which is not a distribution)
    and the entropy of the uniform P."""
    v, u = shape
    vals = values.double()
    nz = vals != 0
    rows = indices[0][nz].bincount(minlength=v)
    cols = indices[1][nz].bincount(minlength=u)
    signed = bool((vals < 0).any())
    pos = vals[vals > 0]
    # W = P / nu, the head weights (each column sums to one)
    col = indices[1]
    w = vals * safe_inv(nu.double())[col]
    live = nu > 0
    col_max = torch.full((u,), -math.inf, dtype=torch.float64).scatter_reduce(0, col, w, "amax")
    col_max = torch.where(col_max.isfinite(), col_max, torch.zeros_like(col_max))
    wp = w.clamp_min(0)  # the unconstrained weights may be negative: entropy of their positive part
    col_h = torch.zeros(u, dtype=torch.float64).index_add_(0, col, -torch.special.xlogy(wp, wp))
    return {**sparsity_summary(rows, cols, col_max[live], col_h[live]),
            "entropy": None if signed else float(-(pos * pos.log()).sum()), "signed": signed,
            "entropy_uniform": math.log(v * u)}


class PStats:
    """The statistics of a :class:`~s2t2_dist.translator.module.TokenTranslator`'s P and the monitor of C's
    gradient (its state: the sampled counts). ``PStats(tr)``; every method is collective when ``tr`` is sharded."""

    def __init__(self, tr):
        self.tr = tr
        self._watching = False


    def _check_group(self, b: StatsBatch) -> None:
        if b.world != self.tr.world_size or (b.group is not None and b.group is not self.tr.group):
            raise ValueError("TokenTranslator statistics: the StatsBatch must reduce over the translator's group")

    def _put(self, b: StatsBatch, name: str, value, op: str = "sum") -> None:
        if self.tr.sharded:
            self._check_group(b)
            b.add(name, value, op)
        else:  # every rank holds the whole P: its statistics are its own, not reduced
            b.add(name, value, "local")

    def _put_rows(self, b: StatsBatch, name: str, value: Tensor, offset: int, total: int) -> None:
        """This rank's rows [offset, offset + n) of a ``total``-row result (unsharded: ``value`` is all of it)."""
        if self.tr.sharded:
            self._check_group(b)
            b.add_rows(name, value, offset, total)
        else:
            b.add(name, value, "local")

    def stats_batch(self) -> StatsBatch:
        """An empty StatsBatch over this translator's ranks, on C's device."""
        return StatsBatch(self.tr.C.device, self.tr.group if self.tr.sharded else None)

    def _alone(self, add, *args):
        """Run one ``add_*`` on a batch of its own (one collective when sharded)."""
        b = self.stats_batch()
        finish = add(b, *args)
        return finish(b.reduce())

    def _stat_P(self, P: Tensor | None) -> Tensor:
        return self.tr.P() if P is None else P.detach()

    @torch.no_grad()
    def add_density(self, b: StatsBatch, P: Tensor | None = None) -> Callable[[Reduced], dict[str, float]]:
        """Non-zeros of the global P (:func:`sparsity_summary`): per source row (summed over the
        column shards) and per target column (this rank's columns)."""
        nz = self._stat_P(P) != 0
        self._put(b, "P.row_nnz", nz.sum(1))
        self._put_rows(b, "P.col_nnz", nz.sum(0), self.tr.col_start, self.tr.u)
        return lambda r: {k: float(x) for k, x in sparsity_summary(r["P.row_nnz"], r["P.col_nnz"]).items()}

    @torch.no_grad()
    def nnz_per_row_and_col(self, P: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Global non-zeros of P per source row (v) and per target column (u), on every rank (host tensors)."""
        def finish(r):
            return torch.from_numpy(r["P.row_nnz"].copy()), torch.from_numpy(r["P.col_nnz"].copy())

        b = self.stats_batch()
        self.add_density(b, P)
        return finish(b.reduce())

    @torch.no_grad()
    def density_stats(self, P: Tensor | None = None) -> dict[str, float]:
        """Summary of the non-zeros of the global P (floats, identical on every rank)."""
        return self._alone(self.add_density, P)

    @torch.no_grad()
    def add_mass(self, b: StatsBatch, P: Tensor | None = None) -> Callable[[Reduced], dict[str, float]]:
        """Mass-based sparsity of the global W = P / nu (head weights; each column sums to one): ``max_weight_mean``
        is the mean over target columns of their largest weight (1.0: every target reads one source token),
        ``col_entropy_mean`` the mean entropy of W's columns in nats (0: one source each; log v: uniform; for the
        unconstrained kind, of the positive part of W). Unlike the non-zero counts of :meth:`add_density`, a column
        with 99% of its mass on one entry counts as (almost) one-hot. Zero-mass columns are left out."""
        W = self.tr.weights(self._stat_P(P), "head")  # one v x u_local temporary, in P's dtype; sums in float64
        if self.tr.live_cols is not None:  # columns of zero mass left out (nu is fixed: the index is the host's)
            W = W.index_select(1, self.tr.live_cols.to(W.device, non_blocking=True))
        if W.shape[1]:
            mx = W.max(0).values.double().sum()
            Wp = W.clamp_min(0)  # the unconstrained weights may be negative: entropy of their positive part
            H = -torch.special.xlogy(Wp, Wp).sum(0).double().sum()
        else:
            mx = H = torch.zeros((), dtype=torch.float64, device=W.device)
        self._put(b, "P.mass", torch.stack([mx, H]))
        self._put(b, "P.live_cols", float(W.shape[1]))

        def finish(r):
            t, n = r["P.mass"], max(float(r["P.live_cols"]), 1.0)
            return {"max_weight_mean": float(t[0]) / n, "col_entropy_mean": float(t[1]) / n}
        return finish

    @torch.no_grad()
    def mass_stats(self, P: Tensor | None = None) -> dict[str, float]:
        """:meth:`add_mass` on a batch of its own: floats, identical on every rank."""
        return self._alone(self.add_mass, P)

    # ------------------------------------------------------------------ gradient monitor (freeze detection)
    def watch_grad(self) -> None:
        """Turn the gradient monitor on. It SAMPLES: :meth:`end_step` reads C's gradient when called (the training
        stage calls it on logging steps only, after the step's backward and before the optimiser step, so that no
        other step reads anything), on the device, without a host sync; :meth:`grad_stats` reads the counts."""
        if not self._watching:
            z = torch.zeros((), dtype=torch.float64, device=self.tr.C.device)
            self._grad_live, self._grad_live_cols, self._grad_zero_run = z, z.clone(), z.clone()
            self._watching = True

    @torch.no_grad()
    def end_step(self, steps: int = 1) -> None:
        """Sample the gradient of C now (call after backward, before the gradient is zeroed); ``steps``: the
        optimiser steps this sample stands for (those since the previous sample). A freeze is then detected on the
        sampled steps: the run of frozen steps grows by ``steps`` per frozen sample, so it may be counted up to
        ``steps - 1`` steps early or late, never missed (a frozen C stays frozen)."""
        if not self._watching:
            return
        g = self.tr.C.grad
        if g is None or not g.numel():
            live = cols = torch.zeros((), dtype=torch.float64, device=self.tr.C.device)
        else:
            nz = g != 0
            live, cols = nz.sum().double(), nz.any(0).sum().double()
        self._grad_live, self._grad_live_cols = live, cols
        # frozen: (almost) no target column still receives gradient (exactly zero, or a few tied entries left)
        stalled = cols < FREEZE_LIVE_COLS * max(self.tr.C.shape[1], 1)
        self._grad_zero_run = torch.where(stalled, self._grad_zero_run + steps, torch.zeros_like(self._grad_zero_run))

    def monitor_state(self) -> dict[str, Tensor]:
        """This rank's gradient-monitor counts, 0-dim tensors where they live (for a checkpoint: saved with the
        engine's state, no host read in the step)."""
        if not self._watching:
            return {}
        return {"live": self._grad_live, "live_cols": self._grad_live_cols, "zero_run": self._grad_zero_run}

    def load_monitor_state(self, state: dict) -> None:
        """Restore :meth:`monitor_state` (a resumed run reports its last sample, not an empty one)."""
        if not state or not self._watching:
            return
        d = self.tr.C.device
        self._grad_live, self._grad_live_cols, self._grad_zero_run = (
            torch.as_tensor(state[k], dtype=torch.float64).to(d) for k in ("live", "live_cols", "zero_run"))

    def add_grad(self, b: StatsBatch) -> Callable[[Reduced], dict[str, float]]:
        """Global gradient-monitor statistics: ``grad_live_frac``, the fraction of all v x u entries of C whose
        gradient was non-zero at the last sample; ``grad_frozen_steps``, the number of consecutive (sampled) steps,
        ending now, on which fewer than ``FREEZE_LIVE_COLS`` of the target columns received any gradient (exactly
        zero, or a few tied entries left: a frozen C), the minimum over ranks of each rank's own run."""
        if not self._watching:
            raise RuntimeError("grad_stats: call watch_grad() first")
        self._put(b, "C.grad_live", self._grad_live)
        self._put(b, "C.grad_zero_run", self._grad_zero_run, "min")
        return lambda r: {"grad_live_frac": float(r["C.grad_live"]) / float(self.tr.v * self.tr.u),
                          "grad_frozen_steps": float(r["C.grad_zero_run"])}

    @torch.no_grad()
    def grad_stats(self) -> dict[str, float]:
        """:meth:`add_grad` on a batch of its own (collective when sharded; one host read)."""
        return self._alone(self.add_grad)

    @torch.no_grad()
    def add_marginals(self, b: StatsBatch, P: Tensor | None = None) -> Callable[[Reduced], dict[str, float]]:
        """Max abs error of the row sums (vs mu) and column sums (vs nu) of the global P after n_iter."""
        P = self._stat_P(P)
        col_err = (P.double().sum(0) - self.tr.nu_local.double()).abs().max() if P.shape[1] else P.new_zeros(())
        self._put(b, "P.row_sums", P.double().sum(1))
        self._put(b, "P.col_err", col_err.double(), "max")
        b.add("P.mu", self.tr.mu.double(), "local")  # read with the rest: the row error is formed on the host

        def finish(r):
            return {"row_err": float(np.abs(r["P.row_sums"] - r["P.mu"]).max()), "col_err": float(r["P.col_err"])}
        return finish

    @torch.no_grad()
    def marginal_errors(self, P: Tensor | None = None) -> dict[str, float]:
        """:meth:`add_marginals` on a batch of its own."""
        return self._alone(self.add_marginals, P)

    @torch.no_grad()
    def add_entropy(self, b: StatsBatch, P: Tensor | None = None) -> Callable[[Reduced], float]:
        """H(P) of the global P (the shares summed in float64, rounded once to P's dtype)."""
        self._put(b, "P.entropy", _entropy(self._stat_P(P)))
        return lambda r: float(r["P.entropy"])

    @torch.no_grad()
    def add_block(self, b: StatsBatch, rows: int, cols: int, P: Tensor | None = None
                  ) -> Callable[[Reduced], Tensor]:
        """The dense top-left ``rows x cols`` block of the global P (for heatmaps): a host tensor in P's dtype."""
        P = self._stat_P(P)
        rows, cols = min(rows, self.tr.v), min(cols, self.tr.u)
        a, e = self.tr.col_start, min(self.tr.col_end, cols)
        mine = P[:rows, : max(e - a, 0)].t()  # this rank's columns [a, e) of the block, as rows
        self._put_rows(b, "P.block", mine, min(a, cols), cols)
        return lambda r: torch.from_numpy(np.ascontiguousarray(r["P.block"].T))

    @torch.no_grad()
    def gather_block(self, rows: int, cols: int, P: Tensor | None = None) -> Tensor:
        """:meth:`add_block` on a batch of its own (every rank)."""
        return self._alone(self.add_block, rows, cols, P)

    @torch.no_grad()
    def add_top(self, b: StatsBatch, k: int = 3, P: Tensor | None = None
                ) -> Callable[[Reduced], dict[int, list[tuple[int, float]]]]:
        """For every target token j (global id): its ``k`` largest source weights ``(i, W_L[i, j])`` (W = P/nu),
        zero weights left out. Identical on every rank."""
        W = self.tr.weights(self._stat_P(P), "head")
        kk = min(k, self.tr.v)
        vals, idx = W.t().topk(kk, dim=1) if W.shape[1] else (W.new_zeros(0, kk), W.new_zeros(0, kk).long())
        self._put_rows(b, "P.top_w", vals, self.tr.col_start, self.tr.u)
        self._put_rows(b, "P.top_i", idx, self.tr.col_start, self.tr.u)

        def finish(r):
            vals, idx = r["P.top_w"].tolist(), r["P.top_i"].tolist()
            return {j: [(int(i), float(w)) for i, w in zip(idx[j], vals[j]) if w > 0] for j in range(len(vals))}
        return finish

    @torch.no_grad()
    def top_translations(self, k: int = 3, P: Tensor | None = None) -> dict[int, list[tuple[int, float]]]:
        """:meth:`add_top` on a batch of its own."""
        return self._alone(self.add_top, k, P)


#: P's sparsity in result.json (start and end of a run)
SPARSITY_KEYS = ("density", "col_nnz_mean", "max_weight_mean", "col_entropy_mean")


def p_sparsity(stats: PStats, batch=None):
    """P's sparsity for result.json: non-zeros (density, per target column) and by mass (mean largest weight and
    entropy of W = P / nu's columns). Without ``batch``: the dict (one collective when sharded); with a StatsBatch:
    registers the partial values into it and returns what finishes the dict from the reduced values."""
    b = stats.stats_batch() if batch is None else batch
    density, mass = stats.add_density(b), stats.add_mass(b)

    def finish(r) -> dict:
        st = {**density(r), **mass(r)}
        return {k: st[k] for k in SPARSITY_KEYS}
    return finish(b.reduce()) if batch is None else finish


def sparsity_warning(start: dict, end: dict, steps: int) -> str:
    """'' unless the learned P has no fewer non-zeros per column than its start and no lower column entropy, and
    more than 5% non-zeros (a sparse start that stays as sparse is what the shipped recipe does). A run of no steps
    (`train.steps=0`, which scores the start) learned nothing, so it is not told to raise alpha."""
    if steps == 0:
        return ""
    if end["col_nnz_mean"] < start["col_nnz_mean"] or end["col_entropy_mean"] < start["col_entropy_mean"] - 1e-6:
        return ""
    if end["density"] <= 0.05:
        return ""
    return (f"the learned P is no sparser than its start ({end['col_nnz_mean']:.1f} non-zeros per target token, "
            f"start {start['col_nnz_mean']:.1f}; column entropy {end['col_entropy_mean']:.2f} nats, start "
            f"{start['col_entropy_mean']:.2f}): raise translator.alpha (docs/translator.md)")


# P's non-zeros with and without the target columns that no source piece builds.
# With a large byte-level source vocabulary a few target tokens have no source pieces at all (`<pad>`, `<unk>`, a
# byte that no source token starts with): the FVT start gives them a uniform column over every source row, so one
# such column holds v non-zeros where a built column holds a handful, and P's overall density says little about
# the rest (SmolLM2, v = 49,152: 23 such columns make the FVT start's density 4.5% where the built columns hold about
# one non-zero each). result.json reports both (`P.start`, `P.end`: `unbuilt_columns`, `density_built`, ...).


def unbuilt_columns(pieces: Sequence[Sequence[int]]) -> list[int]:
    """Target ids whose surface decomposition (`ot.prior.decompose(...).pieces`) has no source piece."""
    return [j for j, p in enumerate(pieces) if not p]


def column_split(col_nnz: torch.Tensor, v: int, unbuilt: Sequence[int]) -> dict:
    """Non-zeros per target column (u) of a v x u P -> density and mean non-zeros per column over the columns some
    source piece builds, and the mean over the unbuilt ones (None when there are none)."""
    col_nnz = torch.as_tensor(col_nnz, dtype=torch.float64).flatten()
    u = col_nnz.numel()
    mask = torch.zeros(u, dtype=torch.bool)
    if len(unbuilt):
        mask[torch.as_tensor(list(unbuilt), dtype=torch.long)] = True
    built = col_nnz[~mask]
    return {"unbuilt_columns": int(mask.sum()),
            "density_built": float(built.sum() / (v * built.numel())) if built.numel() else None,
            "col_nnz_mean_built": float(built.mean()) if built.numel() else None,
            "col_nnz_mean_unbuilt": float(col_nnz[mask].mean()) if mask.any() else None}


def translator_column_split(stats, unbuilt: Sequence[int]) -> dict:
    """`column_split` of a translator's current P, from its :class:`~s2t2_dist.translator.stats.PStats` (one
    collective when C is sharded: call on every rank)."""
    _, cols = stats.nnz_per_row_and_col()
    return column_split(cols, stats.tr.v, unbuilt)
