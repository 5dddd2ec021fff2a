"""The translator's recipe: stage 1's `translator:` section and the ONE resolver of what a run uses.

A key left out or given as null means "the kind's default" (translator/kinds.py holds every per-kind fact);
:meth:`TranslatorConfig.resolve` turns the section (and ``optim.lr``) into the numbers the run uses, a
:class:`Resolved`, and :meth:`TranslatorConfig.build` the translator (torchtitan's ``config.build()``). A given
``optim.lr`` is absolute, as in finetune; the automatic one is the kind's (translator/kinds.py ``auto_lr``: 1/u for
the sparse plan from its start, 1/v unconstrained), so it needs both vocabularies. The paper's literal recipe is a
config file, configs/translate_paper.yaml.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from s2t2_dist.errors import ConfigError
from s2t2_dist.train.config import OptimConfig
from s2t2_dist.translator.kinds import REGISTRY


def _kind(name: str):
    return REGISTRY.lookup(name, "kind")  # a ConfigError naming the registered kinds (translator/kinds.py)


#: what to write instead of a sentinel that meant "the recipe's"
_NULL = "write null (or leave the key out) for the kind's default"


@dataclass(frozen=True)
class Resolved:
    """What a stage-1 run uses, after every automatic key is resolved (result.json's `resolved` block)."""

    kind: str
    #: source tokens (rows of P); None: not known yet (the model's vocabulary)
    v: int | None
    #: target tokens (columns of P); None: not known yet (the new tokenizer)
    u: int | None
    #: AdamW's peak lr of C, absolute; None until v and u are known when it is automatic
    lr: float | None
    #: "given" (optim.lr) or "auto" (the kind's automatic step)
    lr_from: str
    alpha: float
    floor: float
    source_marginal: str
    #: uniform, fvt or p_file (translator.init_p)
    init: str

    @property
    def lr_x_v(self) -> float | None:
        return None if self.lr is None or self.v is None else self.lr * self.v

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "lr_x_v": self.lr_x_v}

    def freeze_warning(self, mu=None) -> str:
        """:func:`freeze_warning` for this run ('' while lr or v is unknown); ``mu``: the run's source marginal."""
        if self.lr is None or self.v is None:
            return ""
        return freeze_warning(self.kind, self.v, self.lr, mu, u=self.u)


@dataclass
class TranslatorConfig:
    #: how C becomes P, a name of translator/kinds.py's registry: sparse: sparse Sinkhorn P (the paper's S2T2);
    #: softmax: dense Sinkhorn baseline; unconstrained: W = C, no OT
    kind: str = "sparse"
    #: full (row, column) Dykstra iterations: 3 = the paper's "iterating 3 times" (Algorithm 1's k = 0..n with n = 2)
    n_iter: int = 3
    #: convex: W_E = W_L = P / nu (E', L' are convex combinations of source rows); paper: the paper's literal
    #: W_E = P / mu, W_L = P / nu
    normalization: Literal["convex", "paper"] = "convex"
    #: weight of the entropy regulariser alpha * H(P), H in nats (larger: sparser P); null: the kind's default
    #: (0.3 for sparse, 0 for the others). Why: docs/translator.md
    alpha: float | None = None
    #: the plan C starts from: uniform (C = 1/v, the paper's) or fvt (each target token's surface-string pieces as
    #: source tokens, plus a shared part; `ot.prior`). Why: docs/translator.md
    init: Literal["uniform", "fvt"] = "fvt"
    #: fvt only: each built column's weight on its own pieces at the start (1: FVT itself); the rest, the shared
    #: part, goes to the most used pieces at any v (`ot.prior.shared_start`). Why 0.8: docs/translator.md
    init_weight: float = 0.8
    #: the source marginal mu (P's row sums). start: the FVT start's row sums (sparse kind, init fvt, no init_p), so
    #: the start is its own plan and P stays sparse; otherwise uniform: 1/v (the paper's; a dense P)
    source_marginal: Literal["start", "uniform"] = "start"
    #: sparse only: weights W = P / nu below floor / v are dropped and each column rescaled (its largest weight
    #: stays). null: 1 for sparse from an fvt start, 0 otherwise. Why: docs/translator.md
    floor: float | None = None
    #: start from a P file instead (e.g. the transfer experiment); overrides `init`
    init_p: str = ""
    #: rows x cols of P shown as a heatmap image in TensorBoard
    heatmap: list[int] = field(default_factory=lambda: [128, 64])
    #: warn (and flag it in result.json) when the gradient on C has been zero (fewer than 5% of the target columns
    #: receiving any) for this many consecutive steps (0: off)
    freeze_steps: int = 50

    #: keys that no longer exist -> what to write instead (config.py reports them in one line)
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "recipe": "optim.lr is absolute and null keys take the kind's defaults; for the paper's recipe use "
                  "--config configs/translate_paper.yaml (recipe: default is what a config without the key does)",
        "dense_frac": "there is no dense warm-up (the informed start, translator.init, replaces it); remove the key",
        "dense_lr": "there is no dense warm-up (the informed start, translator.init, replaces it); remove the key",
    }

    def validate(self) -> None:
        kind = _kind(self.kind)
        if self.n_iter < 1:
            raise ConfigError(f"n_iter: must be >= 1, got {self.n_iter}")
        for key in ("alpha", "floor"):
            x = getattr(self, key)
            if x == -1:
                raise ConfigError(f"{key}: -1 no longer means the recipe's; {_NULL}, or a value >= 0")
            if x is not None and x < 0:
                raise ConfigError(f"{key}: must be >= 0 (null: the kind's default), got {x}")
        if self.floor and not kind.uses_floor:
            raise ConfigError(f"floor: the {self.kind} kind has no weight floor; set 0 or null, got {self.floor}")
        if not 0.0 <= self.init_weight <= 1.0:
            raise ConfigError(f"init_weight: must be in [0, 1], got {self.init_weight}")
        if self.freeze_steps < 0:
            raise ConfigError(f"freeze_steps: must be >= 0, got {self.freeze_steps}")
        if len(self.heatmap) != 2 or min(self.heatmap) < 1:
            raise ConfigError(f"heatmap: need [rows, columns], two numbers >= 1, got {self.heatmap}")

    @property
    def fvt_start(self) -> bool:
        return self.init == "fvt" and not self.init_p

    def resolve(self, v: int | None, u: int | None, *, lr: float | None = None) -> Resolved:
        """The ONE resolver: every automatic key of this section, and ``lr`` (``optim.lr``: absolute, None: the
        kind's automatic step at ``v`` source x ``u`` target tokens), as the run uses them. ``v`` or ``u`` None: the
        automatic lr stays None (it waits for the model's and the tokenizer's vocabularies)."""
        for name, n in (("v", v), ("u", u)):  # (a float here is an lr passed where u goes)
            if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
                raise TypeError(f"resolve: {name} must be a token count >= 1 or None, got {n!r}")
        kind = _kind(self.kind)
        fvt = self.fvt_start
        marginal = "start" if self.source_marginal == "start" and kind.start_marginal and fvt else "uniform"
        if lr is None:
            lr = None if v is None or u is None else kind.auto_lr(v, u, uniform_mu=marginal == "uniform")
            lr_from = "auto"
        else:
            lr_from = "given"
        floor = self.floor if self.floor is not None else (kind.default_floor_fvt if fvt else 0.0)
        return Resolved(
            kind=self.kind, v=v, u=u, lr=lr, lr_from=lr_from,
            alpha=kind.default_alpha if self.alpha is None else float(self.alpha),
            floor=float(floor), source_marginal=marginal,
            init="p_file" if self.init_p else self.init)

    def build(self, v: int, u: int, *, resolved: Resolved | None = None, mu=None, group=None, device=None):
        """The translator of this section: ``v`` source x ``u`` target tokens, C = 1/v (the caller sets an
        informed start: FVT, a P file), ``mu`` the source marginal (None: uniform), column-sharded over ``group``,
        on ``device``."""
        from s2t2_dist.translator.module import TokenTranslator

        r = resolved if resolved is not None else self.resolve(v, u)
        return TokenTranslator(v, u, kind=self.kind, n_iter=self.n_iter, normalization=self.normalization,
                               group=group, mu=mu, floor=r.floor).to(device)

    def describe(self, lr: float | None) -> dict:
        """What :meth:`resolve` gives without the model (`s2t2 config translate`): the values, and for what waits
        for the model's vocabulary v, the rule."""
        r = self.resolve(None, None, lr=lr)
        out = r.as_dict()
        del out["v"], out["u"], out["lr_x_v"]
        out["lr_from"] = {"auto": "auto (optim.lr null, so the automatic step of the kind)",
                          "given": "given (optim.lr, absolute)"}[r.lr_from]
        if r.lr is None:
            kind = _kind(self.kind)
            out["lr"] = (f"{kind.auto_rule(r.source_marginal == 'uniform')} (the automatic step of the {self.kind} "
                         "kind), once v and u are read from the model and the tokenizer")
        return out


@dataclass
class TranslateOptimConfig(OptimConfig):
    #: peak learning rate of C, absolute (as in finetune); null: the kind's automatic step (sparse 0.015 x 1/u,
    #: unconstrained 2.5 x 1/v, softmax 0.1), resolved once v and u are known (result.json's `resolved`)
    lr: float | None = None

    def validate(self) -> None:
        if self.lr == 0:
            raise ConfigError(f"lr: 0 no longer means the recipe's default; {_NULL} (a given lr is absolute)")
        if self.lr is not None and self.lr < 0:
            raise ConfigError(f"lr: must be > 0 (null: the kind's default), got {self.lr}")
        OptimConfig.validate(dataclasses.replace(self, lr=1.0 if self.lr is None else self.lr))


def effective_rows(mu) -> float:
    """The number of source rows the marginal ``mu`` spreads its mass over, 1 / sum(mu_i^2): v for a uniform mu,
    ~487 for SmolLM2's FVT start marginal at v = 49,152 (docs/translator.md, "Step size"). The row projections act at the scale
    of the mu_i of the rows that carry mass, 1 / this on average (mass-weighted)."""
    import torch

    m = torch.as_tensor(mu).double()
    return float(1.0 / (m * m).sum())


def freeze_warning(kind: str, v: int, lr: float, mu=None, u: int | None = None) -> str:
    """A one-line warning when ``lr`` (absolute) is in the range where the kind's plan freezes (translator/kinds.py
    ``freeze_lr_x_v``: for the sparse plan, AdamW moves every entry of C by ~lr per step; past the scale of the row
    projections, mu_i, every support collapses to one entry and sparsemax's Jacobian, hence the gradient on C, is
    exactly zero); '' otherwise. The scale is 1/v for a uniform ``mu`` (None) and 1/:func:`effective_rows` for the
    start's marginal, which puts its mass on few rows: SmolLM2 learns best at lr x v = 2.4 and does not freeze. ``u``
    (target tokens), when known, lets the message give the automatic step's value."""
    k = _kind(kind)
    if k.freeze_lr_x_v is None:
        return ""
    rows = v if mu is None else effective_rows(mu)
    uniform = abs(rows - v) <= 1e-6 * v
    if lr * rows < k.freeze_lr_x_v:
        return ""
    name, scale = ("v", "1/v") if uniform else ("the source marginal's effective rows", f"~1/{rows:.0f}")
    auto = "" if u is None else f" = {k.auto_lr(v, u, uniform_mu=uniform):.3g} here"
    return (f"lr {lr:.3g} is in the freezing range of the {kind} translator for v={v} source tokens (lr x {name} = "
            f"{lr * rows:.3g} >= {k.freeze_lr_x_v:g}): AdamW moves every entry of C by ~lr per step, far past the "
            f"{scale} scale of the projections, and the gradient on C soon becomes exactly zero; lower optim.lr, or "
            f"set it to null for the kind's automatic step ({k.auto_rule(uniform)}{auto})")
