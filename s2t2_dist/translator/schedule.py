"""Step sizes, initialisation and schedule of C for one stage-1 run (the policy; the module is in module.py).

Measured in bench/bench_planted.py and bench/bench_real_model.py; see BENCHMARKS.md."""
from __future__ import annotations

import torch

from s2t2_dist.translator.kinds import REGISTRY
from s2t2_dist.translator.module import KINDS, TokenTranslator  # noqa: F401  (TokenTranslator: annotations)

RECIPES = ("default", "paper")
#: the paper's lr for P (section "Training details"): absolute, whatever v
PAPER_LR = 1e-3
#: default step size of C per kind in units of C's natural scale (step_unit): lr = DEFAULT_STEP[kind] * unit
DEFAULT_STEP = {"sparse": 0.025, "softmax": 0.1, "unconstrained": 2.5}
#: default annealing (start temperature, fraction of the run)
DEFAULT_ANNEAL = (1.0, 0.0)
#: default dense warm-up of the sparse translator (fraction of the run)
DEFAULT_DENSE_FRAC = 0.75


def step_unit(kind: str, v: int) -> float:
    """The natural scale of C's entries: 1/v for the sparse plan (the row projections act at the 1/v scale of
    ``mu``; AdamW moves every entry by ~lr per step, so lr must be a fraction of 1/v) and for the unconstrained
    weights (C = W starts at 1/v); 1 for the softmax plan (C are logits: only differences of O(1) matter)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return REGISTRY[kind].natural_scale(v)


class StepRecipe:
    """The resolved step size, initialisation and schedule of C for one run (see :func:`resolve_step`).

    ``init``: "uniform" (C = 1/v, the paper's) or "noise" (plus Gaussian noise of ``noise`` x the unit).
    Dense warm-up (sparse only): the first ``dense_frac`` of the run trains the softmax (dense Sinkhorn) plan of C
    at ``dense_lr``; then C is set so that the sparse plan starts at that P (:meth:`TokenTranslator.init_from_dense`)
    and the sparse plan trains the rest of the run at ``lr`` with a fresh AdamW state. The exported P is sparse.
    Annealing (sparse and softmax): P is computed from C / T with T going geometrically from ``anneal_t0`` to 1 over
    the first ``anneal_frac`` of the run (denser first)."""

    def __init__(self, kind: str, v: int, recipe: str, lr: float, init: str = "uniform", noise: float = 0.0,
                 anneal_t0: float = 1.0, anneal_frac: float = 0.0, steps: int = 0, dense_frac: float = 0.0,
                 dense_lr: float = 0.0):
        self.kind, self.v, self.recipe, self.lr = kind, v, recipe, lr
        self.init, self.noise = init, noise
        self.anneal_t0, self.anneal_frac, self.steps = anneal_t0, anneal_frac, steps
        self.dense_frac = dense_frac if kind == "sparse" else 0.0
        self.dense_lr = dense_lr
        if kind == "unconstrained":  # P = C * nu: a temperature would only rescale the weights
            self.anneal_t0 = 1.0
        if not 0.0 <= self.dense_frac < 1.0:
            raise ValueError(f"dense_frac must be in [0, 1), got {dense_frac}")

    @property
    def dense_steps(self) -> int:
        # at least the last step is sparse, so the exported plan is
        return min(int(round(self.dense_frac * self.steps)), max(self.steps - 1, 0))

    def temperature(self, step: int) -> float:
        n = int(round(self.anneal_frac * self.steps))
        if self.anneal_t0 == 1.0 or n <= 0 or step >= n:
            return 1.0
        return float(self.anneal_t0 ** (1.0 - step / n))

    def apply_init(self, tr: "TokenTranslator", seed: int = 0):
        """Initialise ``tr.C`` (in place); returns ``schedule(step, engine)``, to call before every forward with
        the number of optimiser steps done (idempotent; after a resume it puts the translator in the phase of that
        step). ``engine``: a :class:`~s2t2_dist.engines.torch_engine.TorchEngine` (its lr is set per phase)."""
        if self.init == "noise" and self.noise > 0:
            g = torch.Generator().manual_seed(seed + 7919 * tr.rank)
            with torch.no_grad():
                z = torch.randn(tr.C.shape, generator=g, dtype=torch.float64).to(tr.C)
                tr.C.add_(z * self.noise * step_unit(tr.kind, tr.v))
        final_kind = tr.kind
        first = [True]
        engine_phase = {}  # the phase last set on each engine (by id): set_phase once per phase

        def schedule(step: int, engine=None) -> None:
            tr.temperature = self.temperature(step)
            if not self.dense_steps:
                return
            if first:  # C after `step` steps is the warm-up's (logits) up to and including step == dense_steps
                tr.kind = "softmax" if step <= self.dense_steps else final_kind
                tr.invalidate()
                first.clear()
            want = "softmax" if step < self.dense_steps else final_kind
            switched = tr.kind != want
            if switched:
                if want == "softmax":  # a fresh start (C constant: the uniform plan either way) or a resume in it
                    tr.kind = "softmax"
                else:  # the switch, in a run that crosses it: the sparse plan starts at the warm-up's P
                    with torch.no_grad():
                        P = tr.P().clone()
                        if tr.sharded:
                            P = tr.comm().all_gather_rows(P.t().contiguous(), tr.col_sizes).t()
                    tr.kind = final_kind
                    tr.invalidate()
                    tr.init_from_dense(P)
                tr.invalidate()
            if engine is not None and engine_phase.get(id(engine)) != want:
                # each phase on its own schedule (warm-up, cosine); a fresh AdamW state at a switch (a resumed
                # engine keeps its loaded state)
                a, b = (0, self.dense_steps) if want == "softmax" else (self.dense_steps, self.steps)
                engine.set_phase(self.dense_lr if want == "softmax" else self.lr, a, b,
                                 reset_state=switched and (step == 0 or want == final_kind))
                engine_phase[id(engine)] = want

        return schedule

    def __repr__(self) -> str:
        return (f"StepRecipe(kind={self.kind}, v={self.v}, recipe={self.recipe}, lr={self.lr:.3g} (lr x v = "
                f"{self.lr * self.v:.3g}), init={self.init}, dense warm-up {self.dense_frac:g} of the run at lr "
                f"{self.dense_lr:.3g}, anneal T {self.anneal_t0:g} -> 1 over {self.anneal_frac:g})")


def resolve_step(kind: str, v: int, *, recipe: str = "default", lr: float = 0.0, init: str = "",
                 noise: float = 0.1, anneal_t0: float = -1.0, anneal_frac: float = -1.0, dense_frac: float = -1.0,
                 dense_lr: float = 0.0, steps: int = 0) -> StepRecipe:
    """The absolute lr of C, its initialisation and schedule (negative / zero / empty arguments: the recipe's).

    ``recipe="paper"``: the paper's literal recipe: C = 1/v, ``lr`` absolute (0: the paper's 1e-3), no warm-up,
    no annealing. ``recipe="default"``: ``lr`` and ``dense_lr`` are in units of :func:`step_unit` (0:
    ``DEFAULT_STEP``), so one value works for every v; dense warm-up and annealing per ``DEFAULT_DENSE_FRAC`` and
    ``DEFAULT_ANNEAL``."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if lr < 0 or dense_lr < 0:
        raise ValueError(f"lr and dense_lr must be >= 0 (0: the recipe's default), got {lr}, {dense_lr}")
    if recipe == "paper":
        return StepRecipe(kind, v, recipe, lr or PAPER_LR, init or "uniform", noise, max(anneal_t0, 1.0),
                          max(anneal_frac, 0.0), steps, max(dense_frac, 0.0), dense_lr or PAPER_LR)
    t0, frac = DEFAULT_ANNEAL
    eff = (lr or DEFAULT_STEP[kind]) * step_unit(kind, v)
    dense = (dense_lr or DEFAULT_STEP["softmax"]) * step_unit("softmax", v)
    return StepRecipe(kind, v, recipe, eff, init or "uniform", noise, anneal_t0 if anneal_t0 >= 1 else t0,
                      anneal_frac if anneal_frac >= 0 else frac, steps,
                      dense_frac if dense_frac >= 0 else DEFAULT_DENSE_FRAC, dense)


#: lr x v from which the sparse plan's gradient dies within a few hundred steps (bench/bench_planted.py)
FREEZE_LR_X_V = 1.0


def freeze_warning(kind: str, v: int, lr: float) -> str:
    """A one-line warning when ``lr`` (absolute) is in the range where the sparse plan freezes for this ``v``
    (AdamW moves every entry of C by ~lr per step; past the 1/v scale of the row projections every support
    collapses to one entry and sparsemax's Jacobian, hence the gradient on C, is exactly zero); '' otherwise."""
    if kind != "sparse" or lr * v < FREEZE_LR_X_V:
        return ""
    return (f"lr {lr:.3g} is in the freezing range of the sparse translator for v={v} source tokens (lr x v = "
            f"{lr * v:.3g} >= {FREEZE_LR_X_V:g}): AdamW moves every entry of C by ~lr per step, far past the 1/v "
            f"scale of the projections, and the gradient on C soon becomes exactly zero; use translator.recipe="
            f"default (lr in units of 1/v; default {DEFAULT_STEP['sparse']} x 1/v)")
