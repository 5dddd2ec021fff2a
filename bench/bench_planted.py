"""Planted-translation benchmark: can a translator recover a token translation whose optimum is known?

A frozen language model over v source tokens (a context-window MLP LM: the last 3 tokens' embeddings through a
tanh MLP with a residual, then the head; random weights, not a bigram table) writes target text through a planted
translation sigma (target j -> source sigma(j)): the target data are SAMPLED from the translated model whose
weights W* = P*/nu are the one-hot columns of sigma, so W* is the best translation there is and its loss on
held-out text is the oracle. Two regimes:

* ``many``: v > u, each target token stands for one source token (sigma injective; most sources unused);
* ``split``: v < u, the paper's regime: each source token is written as one of u/v target tokens (sigma onto).

Every translator (``TokenTranslator``: sparse = S2T2, softmax, unconstrained) is trained by the translate stage's
own engine (AdamW, cosine schedule, clipping) from the uniform start, with the step size the stage resolves
(``TranslatorConfig.resolve`` under the uniform source marginal: 0.025 x 1/v for the sparse kind) and, for the
sparse kind, the dense warm-up that the stage had before its FVT start replaced it (:class:`WarmUp`, kept here so
the planted records of benchmarks/stage1_planted_cpu2_2026-11-27.md reproduce). ``--lr`` is in units of C's scale
(1/v for sparse and unconstrained, 1 for softmax) with ``--recipe default`` and absolute with ``--recipe paper``
(C = 1/v, no warm-up, 1e-3 by default). Reported: recovery (fraction of targets whose largest
weight is on sigma(j)), loss gap to the oracle (nats/token, held out), mass-based sparsity (mean largest weight per
column of W, mean column entropy), the fraction of C with a live gradient at the end, and the loss of the uniform
P (the start) for scale.

    python -m bench.bench_planted --v 256 --steps 600                          # split regime, the three kinds
    python -m bench.bench_planted --v 256 --steps 600 --recipe paper           # the paper's literal recipe
    python -m bench.bench_planted --v 4096 --u 256 --regime many --steps 300
    python -m bench.bench_planted --v 50280 --u 64 --regime many --steps 100   # minutes per kind on 2 cores
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from s2t2_dist.api import TorchEngine
from s2t2_dist.api import OptimConfig
from s2t2_dist.api import PStats, TokenTranslator, TranslatorConfig
from s2t2_dist.api import REGISTRY

#: the paper's lr for P (section "Training details"): absolute, whatever v
PAPER_LR = 1e-3
#: the dense warm-up of the sparse translator from the uniform start (fraction of the run)
DEFAULT_DENSE_FRAC = 0.75


class WarmUp:
    """The step size of C and, for the sparse kind, the dense warm-up from the uniform start (:func:`resolve`).

    The first ``dense_frac`` of the run trains a softmax (dense Sinkhorn) translator at ``dense_lr``; then a translator
    of the run's kind starts at that P (:meth:`TokenTranslator.init_from_dense`) and trains the rest of the run at
    ``lr`` with an engine of its own (a fresh AdamW state, its own warm-up and cosine). The exported P is sparse.
    (The stage dropped it: its FVT start is informed.)"""

    def __init__(self, kind: str, v: int, recipe: str, lr: float, init: str = "uniform", steps: int = 0,
                 dense_frac: float = 0.0, dense_lr: float = 0.0):
        self.kind, self.v, self.recipe, self.lr = kind, v, recipe, lr
        self.init, self.steps = init, steps
        # the warm-up is the sparse plan's (its uniform start's poor optimum); the dense kinds need none
        self.dense_frac = dense_frac if REGISTRY[kind].sparse_product else 0.0
        self.dense_lr = dense_lr
        if not 0.0 <= self.dense_frac < 1.0:
            raise ValueError(f"dense_frac must be in [0, 1), got {dense_frac}")

    @property
    def dense_steps(self) -> int:
        # at least the last step is sparse, so the exported plan is
        return min(int(round(self.dense_frac * self.steps)), max(self.steps - 1, 0))

    def phases(self) -> list[tuple[str, float, int]]:
        """(kind, lr, steps) of each phase: the warm-up (if any), then the run's kind."""
        d = self.dense_steps
        return ([("softmax", self.dense_lr, d)] if d else []) + [(self.kind, self.lr, self.steps - d)]


def resolve(kind: str, v: int, u: int, *, recipe: str = "default", lr: float = 0.0, init: str = "",
            dense_frac: float = -1.0, dense_lr: float = 0.0, steps: int = 0) -> WarmUp:
    """The bench's step: ``recipe="paper"``: C = 1/v, ``lr`` absolute (0: the paper's 1e-3), no warm-up;
    ``"default"``: ``lr`` and ``dense_lr`` in units of C's scale (0: the stage's automatic lr from this uniform
    start, resolved by ``TranslatorConfig.resolve``), a dense warm-up of ``DEFAULT_DENSE_FRAC`` for the sparse kind."""
    if recipe == "paper":
        return WarmUp(kind, v, recipe, lr or PAPER_LR, init or "uniform", steps, max(dense_frac, 0.0),
                      dense_lr or PAPER_LR)
    k, soft = REGISTRY[kind], REGISTRY["softmax"]
    eff = lr * k.c_scale(v) if lr else TranslatorConfig(kind=kind, init="uniform").resolve(v, u).lr
    dense = dense_lr * soft.c_scale(v) if dense_lr else soft.auto_lr(v, u, uniform_mu=True)
    return WarmUp(kind, v, recipe, eff, init or "uniform", steps,
                  dense_frac if dense_frac >= 0 else DEFAULT_DENSE_FRAC, dense)


class ContextMLPLM(nn.Module):
    """Frozen LM: logits_t = scale * (x_t + MLP([x_{t-2}, x_{t-1}, x_t])) @ L^T, x = E[ids] (E, L given)."""

    def __init__(self, d: int, ctx: int = 3, hidden: int = 128, scale: float = 1.0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ctx, self.scale = ctx, scale
        self.w1 = nn.Parameter(torch.randn(ctx * d, hidden, generator=g) / math.sqrt(ctx * d), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(hidden, d, generator=g) * 2.0 / math.sqrt(hidden), requires_grad=False)

    def hidden(self, x):  # x: B, T, d
        shifted = [F.pad(x, (0, 0, k, 0))[:, : x.shape[1]] for k in range(self.ctx)]
        return x + torch.tanh(torch.cat(shifted, -1) @ self.w1) @ self.w2

    def forward(self, ids, E_new, L_new):
        return self.scale * self.hidden(E_new[ids]) @ L_new.t()


@dataclass
class Problem:
    v: int
    u: int
    sigma: torch.Tensor  # u: the planted source of each target
    E: torch.Tensor
    L: torch.Tensor
    lm: ContextMLPLM
    train: torch.Tensor  # N x T target ids
    held: torch.Tensor

    def loss(self, E_new, L_new, ids) -> torch.Tensor:
        logits = self.lm(ids[:, :-1], E_new, L_new)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def make_problem(v: int, u: int, regime: str, d: int = 32, seq: int = 33, n_train: int = 4096, n_held: int = 256,
                 seed: int = 0, temp_scale: float = 3.0) -> Problem:
    g = torch.Generator().manual_seed(seed)
    if regime == "many":
        if u > v:
            raise ValueError("regime many needs u <= v")
        sigma = torch.randperm(v, generator=g)[:u]
    elif regime == "split":
        if u % v:
            raise ValueError("regime split needs u a multiple of v")
        sigma = torch.randperm(u, generator=g) % v  # every source written as u/v targets
    else:
        raise ValueError(regime)
    E = torch.randn(v, d, generator=g)
    L = torch.randn(v, d, generator=g) / math.sqrt(d)
    lm = ContextMLPLM(d, scale=temp_scale, seed=seed + 1)
    E_star, L_star = E[sigma], L[sigma]
    with torch.no_grad():
        n = n_train + n_held
        ids = torch.randint(0, u, (n, 1), generator=g)
        for _ in range(seq - 1):  # sample target text from the model translated by the planted map
            logits = lm(ids[:, -3:], E_star, L_star)[:, -1]
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)], 1)
    return Problem(v, u, sigma, E, L, lm, ids[:n_train], ids[n_train:])


def uniform_loss(pb: Problem) -> float:
    with torch.no_grad():
        m = pb.E.mean(0, keepdim=True).expand(pb.u, -1), pb.L.mean(0, keepdim=True).expand(pb.u, -1)
        return float(pb.loss(m[0], m[1], pb.held))


def oracle_loss(pb: Problem) -> float:
    with torch.no_grad():
        return float(pb.loss(pb.E[pb.sigma], pb.L[pb.sigma], pb.held))


def train(pb: Problem, step: WarmUp, mu: torch.Tensor | None = None, *, batch: int = 32, eps: float = 1e-5,
          generator: torch.Generator | None = None, log_every: int = 0):
    """Train through ``step``'s phases, each a translator of its kind with an engine of its own, the next started at
    the previous one's P; returns (the last translator, its statistics, the last loss)."""
    tr = stats = loss = None
    for kind, lr, n in step.phases():
        nxt = TokenTranslator(pb.v, pb.u, kind=kind, mu=mu)
        if tr is not None:
            with torch.no_grad():
                nxt.init_from_dense(tr.P().detach().clone())
        tr = nxt
        stats = PStats(tr)
        stats.watch_grad()
        engine = TorchEngine.build(tr, OptimConfig(lr=lr, eps=eps), n, params="sharded")
        for s in range(n):
            idx = torch.randint(0, pb.train.shape[0], (batch,), generator=generator)
            E_new, L_new = tr.embed_and_head(pb.E, pb.L)
            loss = pb.loss(E_new, L_new, pb.train[idx])
            engine.backward(loss)
            stats.end_step()  # samples the gradient of C: before the step zeroes it
            engine.step()
            if log_every and (s + 1) % log_every == 0:
                print(f"  {kind} step {s + 1} loss {float(loss):.4f} {stats.grad_stats()} {stats.mass_stats()}",
                      file=sys.stderr)
    return tr, stats, loss


def run_one(pb: Problem, kind: str, *, recipe: str = "default", lr: float = 0.0, steps: int = 300, batch: int = 32,
            init: str = "", dense_frac: float = -1.0, dense_lr: float = 0.0, eps: float = 1e-5, mu: str = "uniform", seed: int = 0, log_every: int = 0
            ) -> dict:
    """Train one translator on the planted problem; returns the metrics (see the module docstring).

    ``mu``: "uniform" (the stage's row marginal) or "freq": the source tokens' frequencies under the planted map
    (1% of the mass spread uniformly, so no row is empty). With uniform mu and v > u the planted P is infeasible:
    exact row sums 1/v cap every weight W_ij = P_ij / nu_j at u/v."""
    torch.manual_seed(seed)
    m = None
    if mu == "freq":
        m = torch.bincount(pb.sigma, minlength=pb.v).double() / pb.u * 0.99 + 0.01 / pb.v
    step = resolve(kind, pb.v, pb.u, recipe=recipe, lr=lr, init=init, dense_frac=dense_frac, dense_lr=dense_lr,
                   steps=steps)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    tr, stats, loss = train(pb, step, m, batch=batch, eps=eps, generator=g, log_every=log_every)
    dt = time.perf_counter() - t0
    with torch.no_grad():
        E_new, L_new = tr.embed_and_head(pb.E, pb.L)
        held = float(pb.loss(E_new, L_new, pb.held))
        W = tr.weights(tr.P(), "head")
        rec = float((W.argmax(0) == pb.sigma).double().mean())
        ms = stats.mass_stats()
    gs = stats.grad_stats()
    return {"kind": kind, "recipe": recipe, "lr": step.lr, "lr_x_v": step.lr * pb.v, "init": step.init,
            "dense_frac": step.dense_frac, "dense_lr": step.dense_lr, "eps": eps, "mu": mu, "steps": steps, "held_loss": held, "recovery": rec,
            "max_weight_mean": ms["max_weight_mean"], "col_entropy_mean": ms["col_entropy_mean"],
            "grad_live_frac": gs["grad_live_frac"], "grad_frozen_steps": gs["grad_frozen_steps"],
            "seconds": round(dt, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--v", type=int, default=256)
    ap.add_argument("--u", type=int, default=0, help="default: 2v (split) or min(v/2, 512) (many)")
    ap.add_argument("--regime", choices=["many", "split"], default="split")
    ap.add_argument("--kinds", nargs="+", default=["sparse", "softmax", "unconstrained"])
    ap.add_argument("--recipe", choices=["default", "paper"], default="default")
    ap.add_argument("--lr", type=float, nargs="+", default=[0.0], help="0: the recipe's default for the kind")
    ap.add_argument("--init", default="", help="'' (recipe default: uniform)")
    ap.add_argument("--dense-frac", type=float, default=-1.0, help="dense warm-up fraction (-1: recipe default)")
    ap.add_argument("--dense-lr", type=float, default=0.0, help="dense warm-up lr (0: recipe default)")
    ap.add_argument("--eps", type=float, default=1e-5, help="AdamW eps (the stage's optim.eps; paper 1e-5)")
    ap.add_argument("--mu", choices=["uniform", "freq"], default="uniform", help="row marginal (see run_one)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=0)
    ap.add_argument("--json", default="", help="append one JSON line per run to this file")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    u = a.u or (2 * a.v if a.regime == "split" else min(a.v // 2, 512))
    pb = make_problem(a.v, u, a.regime, seed=a.seed)
    base = {"v": a.v, "u": u, "regime": a.regime, "uniform_loss": uniform_loss(pb), "oracle_loss": oracle_loss(pb)}
    print(f"# v={a.v} u={u} regime={a.regime} mu={a.mu} eps={a.eps:g}: oracle {base['oracle_loss']:.4f}, uniform P {base['uniform_loss']:.4f}")
    print("| kind | recipe | init | dense warm-up | lr | lr x v | recovery | loss gap | max weight | col entropy | live grad "
          "| zero-grad steps | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in a.kinds:
        for lr in a.lr:
            r = run_one(pb, kind, recipe=a.recipe, lr=lr, steps=a.steps, batch=a.batch, init=a.init,
                        dense_frac=a.dense_frac, dense_lr=a.dense_lr, eps=a.eps, mu=a.mu, seed=a.seed, log_every=a.log_every)
            r.update(base, gap=r["held_loss"] - base["oracle_loss"])
            print(f"| {kind} | {a.recipe} | {r['init']} | {r['dense_frac']:g} | {r['lr']:.3g} | {r['lr_x_v']:.3g} | "
                  f"{r['recovery']:.3f} | {r['gap']:.4f} | {r['max_weight_mean']:.3f} | {r['col_entropy_mean']:.3f} | "
                  f"{r['grad_live_frac']:.4f} | {r['grad_frozen_steps']:.0f} | {r['seconds']} |", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
