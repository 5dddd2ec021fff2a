"""Translator kinds: how C becomes P, and every per-kind fact the rest of the package reads (the recipe's defaults
in translator/recipe.py, the P file's checks in translator/pfile.py). One small class per kind behind one
interface; a new kind is a class here (or in its own file) and one entry in :data:`REGISTRY` (:func:`register`).

A kind is built per translator (``REGISTRY[name](tr)``) so it can keep per-run state (the sparse solver) and read
the translator's shape, marginals and process group.
"""
from __future__ import annotations


import torch
from torch import Tensor

from s2t2_dist.distributed.sharded_sinkhorn import ShardedSparseSinkhorn, sharded_softmax_sinkhorn
from s2t2_dist.ot.sinkhorn import SparseSinkhorn, softmax_sinkhorn, unconstrained_plan
from s2t2_dist.translator.floor import NOISE_W, floor_plan
from s2t2_dist.ot.marginals import safe_inv
from s2t2_dist.registry import Registry
from s2t2_dist.utils.routes import record


class Kind:
    """The interface. The solvers run unchecked (a check reads values back: a host sync in the step): the translator
    checks mu and nu when built and C where it is set from outside (init_from_dense); a C that turns non-finite
    in training makes the loss non-finite, which the loop's bad-step check catches. ``tr`` is the :class:`~s2t2_dist.translator.module.TokenTranslator` (its ``mu``, ``nu_local``,
    ``n_iter``, ``group``, ``sharded``, ``comm()``)."""

    #: the registry name
    name = ""
    #: P is a transport plan (non-negative, marginals mu and nu); False: signed weights scaled by nu
    is_probability = True
    #: P's rows are mostly all-zero and :meth:`plan`'s backward reads P's gradient only on P's support: the
    #: product E' = P^T E may take the live-row kernels (translator/product.py)
    sparse_product = False
    #: the default step size of C (AdamW's lr) in units of :attr:`step_unit`
    default_step = 0.1
    #: the unit of the automatic step: "1", "1/v" (source tokens) or "1/u" (target tokens)
    step_unit = "1"
    #: the default entropy weight alpha (translator.alpha: null)
    default_alpha = 0.0
    #: :meth:`plan` reads the translator's weight floor (translator.floor); others refuse a floor > 0
    uses_floor = False
    #: the default weight floor (units of 1/v) from an FVT start (translator.floor: null); 0 from any other start
    default_floor_fvt = 0.0
    #: an FVT start may set the source marginal mu to its own row sums (translator.source_marginal: start), so that
    #: the start is feasible and its zeros stay zeros
    start_marginal = False
    #: lr x v from which the plan's gradient dies within a few hundred steps (None: no such range;
    #: bench/bench_planted.py, uniform mu); v is the rows mu spreads over (recipe.effective_rows) when the start's
    #: marginal holds few; translator/recipe.py warns at start
    freeze_lr_x_v: float | None = None

    def __init__(self, tr):
        self.tr = tr

    @staticmethod
    def c_scale(v: int) -> float:
        """The size of C's entries at a uniform start over ``v`` source tokens (benches give steps in these units)."""
        return 1.0

    @classmethod
    def auto_step(cls, uniform_mu: bool) -> tuple[float, str]:
        """The automatic step, the one home of its rule: (step, unit), the lr being step x unit with unit one of
        "1", "1/v", "1/u"; ``uniform_mu``: the source marginal is mu = 1/v (else the start's own)."""
        return cls.default_step, cls.step_unit

    @classmethod
    def auto_lr(cls, v: int, u: int, uniform_mu: bool) -> float:
        """The automatic lr at ``v`` source x ``u`` target tokens (translator/recipe.py)."""
        step, unit = cls.auto_step(uniform_mu)
        return step / {"1": 1, "1/v": v, "1/u": u}[unit]

    @classmethod
    def auto_rule(cls, uniform_mu: bool) -> str:
        """:meth:`auto_step` in words ("0.015 x 1/u": messages, `s2t2 config translate`)."""
        step, unit = cls.auto_step(uniform_mu)
        return f"{step:g} x {unit}"

    @classmethod
    def auto_tag(cls, uniform_mu: bool) -> str:
        """:meth:`auto_step` as a name part ("auto0.015_per_u"): a run named by it is never mistaken for a run at
        another rule."""
        step, unit = cls.auto_step(uniform_mu)
        return f"auto{step:g}" + ("" if unit == "1" else "_per_" + unit.removeprefix("1/"))

    def plan(self, C: Tensor) -> Tensor:
        """This rank's block of P (v x u_local) from its block of C (differentiable)."""
        raise NotImplementedError

    def init_from_plan(self, P: Tensor) -> Tensor:
        """A block of C (float64) whose plan is (approximately) the given feasible block of P (float64)."""
        raise NotImplementedError


#: the zeros of a sparse start sit this far (in units of 1/v) below the projections' thresholds
START_MARGIN = 0.1


class SparseKind(Kind):
    """The paper's S2T2: sparse Sinkhorn (Dykstra with sparsemax projections). C lives at P's scale."""

    name = "sparse"
    # sparsemax's Jacobian S * (h - mean_S h) and the floor's backward read the gradient on the support only
    sparse_product = True
    # why this step, alpha, floor and source marginal: docs/translator.md. From the start's own marginal (a sparse
    # start on few rows) the entries that matter are a column's few weights, each ~nu_j / k with nu_j = 1/u, and
    # AdamW moves every entry of C by ~lr a step: the best step measured follows 1/u, not v ("Step size")
    default_step = 0.015
    step_unit = "1/u"
    #: the automatic step under a uniform source marginal, in units of 1/v: from a start spread over all v rows
    #: every entry of C has the 1/v scale of the row projections to travel (the planted bench, stories260K)
    uniform_step = 0.025
    default_alpha = 0.3
    uses_floor = True
    default_floor_fvt = 1.0
    start_marginal = True
    # AdamW moves every entry of C by ~lr per step; past the 1/v scale of the row projections every support
    # collapses to one entry and sparsemax's Jacobian, hence the gradient on C, is exactly zero
    freeze_lr_x_v = 1.0

    def __init__(self, tr):
        super().__init__(tr)
        self._solver = None

    @staticmethod
    def c_scale(v: int) -> float:
        return 1.0 / v

    @classmethod
    def auto_step(cls, uniform_mu: bool) -> tuple[float, str]:
        return (cls.uniform_step, "1/v") if uniform_mu else (cls.default_step, cls.step_unit)

    def solver(self):
        """The Sinkhorn solver (one per run; it follows C's device and dtype)."""
        tr = self.tr
        if self._solver is None:
            self._solver = (ShardedSparseSinkhorn(tr.mu, tr.nu_local, tr.u, tr.group, validate=False) if tr.sharded
                            else SparseSinkhorn(tr.mu, tr.nu, validate=False, on_route=record))
        return self._solver

    def plan(self, C: Tensor) -> Tensor:
        floor = self.tr.floor
        if not floor:
            # A column short of nu_j by a rounding error lifts every zero of its input by that error / v (the
            # threshold drops below the tied zeros): float noise (W < 1e-6) that would count as non-zeros and fill
            # the P file. Zeroed; a real weight of the plan is far larger.
            P = self.solver()(C, self.tr.n_iter)
            return torch.where(P > NOISE_W * self.tr.nu_local.to(P.dtype), P, 0)
        # The same lift, at the scale of training: the row step shaves a column's entries (its row gave mass
        # elsewhere), and the column step refills the short column evenly over ALL its zeros (they tie at 0 in
        # its input), i.e. a full column of weights far below 1/v whose C entries get no gradient. Dropped (and
        # the column rescaled to nu_j, differentiably), so the plan keeps only the weights it learned. A column the
        # row step emptied ENTIRELY comes back flat (nu_j / v on every source, all tied) and would keep everything:
        # it takes C's largest entry instead, one-hot (stories260K seeds 1, 2: +0.06 BpB before; docs/translator.md,
        # "floor"). See translator/floor.py (one Function, in place).
        return floor_plan(self.solver()(C, self.tr.n_iter), C, self.tr.nu_local, floor)

    def init_from_plan(self, P: Tensor) -> Tensor:
        # a feasible P is its own projection; its zeros start START_MARGIN / v below every threshold, so that
        # they stay off the support (no gradient: sparsemax's Jacobian) until training lowers a threshold that far
        return torch.where(P > 0, P, torch.full((), -START_MARGIN / P.shape[0], dtype=P.dtype, device=P.device))


class SoftmaxKind(Kind):
    """The dense Sinkhorn baseline (softmax projections). C are logits: only differences of O(1) matter."""

    name = "softmax"
    default_step = 0.1

    def plan(self, C: Tensor) -> Tensor:
        tr = self.tr
        if tr.sharded:
            return sharded_softmax_sinkhorn(C, tr.mu, tr.nu_local, n_iter=tr.n_iter, comm=tr.comm())
        return softmax_sinkhorn(C, tr.mu, tr.nu, tr.n_iter, validate=False)

    def init_from_plan(self, P: Tensor) -> Tensor:
        return P.clamp(min=1e-30).log()


class UnconstrainedKind(Kind):
    """No transport: ``P = C * nu``, so the weights ``P / nu`` are C itself (signed, any scale; starts at 1/v)."""

    name = "unconstrained"
    is_probability = False
    default_step = 2.5
    step_unit = "1/v"

    @staticmethod
    def c_scale(v: int) -> float:
        return 1.0 / v

    def plan(self, C: Tensor) -> Tensor:
        return unconstrained_plan(C, self.tr.nu_local)

    def init_from_plan(self, P: Tensor) -> Tensor:
        return P * safe_inv(self.tr.nu_local.double()).unsqueeze(0)


#: name -> kind class; the names are translator.kind's values
REGISTRY: Registry = Registry("translator kind")


def register(cls: type[Kind]) -> type[Kind]:
    """Add a kind to :data:`REGISTRY` under its ``name`` (usable as a class decorator)."""
    return REGISTRY.register(cls.name, cls)


for _k in (SparseKind, SoftmaxKind, UnconstrainedKind):
    register(_k)
