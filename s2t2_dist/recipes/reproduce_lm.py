"""`s2t2 reproduce --scale smollm2`: the paper's Table 1 with a real pretrained LM (SmolLM2-135M-Instruct) on real
proteins, in the paper's setting: single-character source tokens, a new 512-token BPE, P-only and + CFT rows, the
two finetuning baselines, every row scored on the same held-out sequences and bytes.

Phases (each arm a real `translate` / `finetune` / `evaluate` run in its own run directory under OUT/runs):
  select   seed 0, on a validation split carved from the training data (never the held-out one):
           the S2T2 P-only curve (`curve_steps`, validation BpB every `eval_every` steps); every P kind at each
           step size of its grid (`p_lr_sweep.*`, `p_steps` steps), the dense baselines from each start; the P-only
           ceiling probe's step (`lm.probe_lr_sweep`: E' and L' free on the frozen body from S2T2's start).
  grid     seed 0: every finetuned row at every step of `lm.ft_lr_sweep` (`ft_steps` steps), each row's own step
           chosen on validation (every baseline at its best step), each point also scored held out (the bracket).
  table    every seed: Plain P, Sinkhorn P (each at its chosen start, and from S2T2's start), S2T2, each P-only
           and + CFT at the row's own finetuning step; S2T2 P-only also at the paper's alpha 0, from the shipped or
           the paper's start (P-only); S2T2's start (0 P-only steps) + CFT; FT orig. tok.; FT new tok.; the
           training-free FVT start; on seed 0 S2T2's start itself and the ceiling probe (the P-only rows' two
           ends); each scored on the held-out split, each document's score kept (the paired intervals).
           Seed 0's runs are the selection's and the grid's (same arguments, reused).
Arms run in `lanes` parallel processes (`OMP_NUM_THREADS` = cores / lanes). A rerun skips finished arms (their small
result record in OUT/record, which can be kept across machines: `--record`) and resumes interrupted ones from their
latest checkpoint. A record stands for an arm only if it was made with the arm's spec (its steps, lrs, seed, ... and
those of the arms it read: recipes/arm_records.py), so other steps or a P made another way run the arm again.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from s2t2_dist.recipes.arm_records import EXTRA_RECORDS, read_result, upstream_of, write_record
from s2t2_dist.recipes.orchestrate import REPO_ROOT, Runner, StageFailed, fmt_seconds
from s2t2_dist.recipes.paper_plan import Job, ReproduceConfig
from s2t2_dist.recipes.reproduce_lm_report import FT_ROWS

#: translator kind per P column of Table 1 (s2t2_a0: S2T2 at the paper's entropy weight 0; *_fvt: the dense
#: baseline from S2T2's start, so that every translator is finetuned from that start too)
P_COLUMNS = {"plain_p": "unconstrained", "plain_p_fvt": "unconstrained", "sinkhorn_p": "softmax",
             "sinkhorn_p_fvt": "softmax", "s2t2": "sparse", "s2t2_a0": "sparse"}
#: the P column each P + CFT row finetunes from
FT_P_ROW = {"plain_p_cft": "plain_p", "plain_p_fvt_cft": "plain_p_fvt", "sinkhorn_p_cft": "sinkhorn_p",
            "sinkhorn_p_fvt_cft": "sinkhorn_p_fvt", "s2t2_cft": "s2t2"}
#: the validation split's hash seed inside the training split (the held-out split uses protein_corpus.HELDOUT_SEED)
VALIDATION_SEED = 1
VALIDATION_FRACTION = 0.1


def training_precision(key: str) -> str:
    """lm.precision as the arms run it: auto is bf16 on a GPU or a CPU with bf16 in hardware, else fp32."""
    if key != "auto":
        return key
    import torch

    from s2t2_dist.api import cpu_computes_bf16

    return "bf16" if torch.cuda.is_available() or cpu_computes_bf16() else "fp32"


def precision_warning(key: str) -> list[str]:
    """The lines that tell a user the arms will train in bf16 on a CPU that only emulates it (each step ~15x
    slower than fp32 there: 180 against 12 s for a SmolLM2 finetune step on an AVX2 CPU); none otherwise."""
    import torch

    from s2t2_dist.api import cpu_computes_bf16

    if training_precision(key) != "bf16" or torch.cuda.is_available() or cpu_computes_bf16():
        return []
    return [f"  WARNING lm.precision={key}: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no bf16 in "
            "hardware, so every training step is emulated, ~15x slower than fp32; lm.precision=fp32 (or auto) is "
            "fast here, but then no kept record (bf16 arms) stands for its arms"]


def _lr_tag(lr: float) -> str:
    return f"lr{lr:g}"


@dataclass
class Arm:
    """One way of learning a P: the translator kind, its start (shipped: the FVT start and its marginal; paper:
    C = 1/v, uniform mu, alpha 0, no floor), its entropy weight (None: the kind's) and its step."""

    kind: str
    start: str
    alpha: float | None
    lr: float

    def label(self) -> str:
        return f"{self.start} start" + ("" if self.alpha is None else f", alpha {self.alpha:g}") + f", lr {self.lr:g}"


@dataclass
class LmPaths:
    out: Path
    model: str  # the source model directory (s2t2 source-lm smollm2)
    data: Path  # prepare output: tokenizer/, shards/{new,source}/{train,eval} (eval = the validation split)
    heldout_new: str  # held-out eval shards, new BPE
    heldout_source: str  # held-out eval shards, the source model's tokenizer

    @property
    def runs(self) -> Path:
        return self.out / "runs"


class LmPlan:
    """The jobs of the real-LM reproduction: built from the config, the paths and the selections made so far."""

    def __init__(self, cfg: ReproduceConfig, paths: LmPaths):
        self.cfg, self.p = cfg, paths
        self.precision = training_precision(cfg.lm.precision)

    # -- single jobs -----------------------------------------------------------------------------------------
    def _common(self, seed: int) -> list[str]:
        c = self.cfg
        return [f"train.batch_size={c.batch_size}", f"train.micro_batch_size={c.batch_size}",
                f"train.context_len={c.context_len}", f"train.log_every={c.log_every}", f"train.seed={seed}",
                f"train.precision={self.precision}", f"train.ckpt_every={c.lm.ckpt_every}", "data.num_workers=0",
                f"train.eval_max_docs={c.eval_max_docs}"]

    def translate(self, name: str, kind: str, lr: float | None, seed: int, steps: int, *, start: str,
                  alpha: float | None = None, eval_every: int = 0) -> Job:
        """Stage 1 on the validation split. start "shipped": the project's recipe (FVT start, its marginal, the
        kind's alpha and floor); "paper": C = 1/v, uniform mu, alpha 0, no floor."""
        d, rd = self.p.data, str(self.p.runs / name)
        ov = [f"run_dir={rd}", f"model.path={self.p.model}", f"model.source_vocab={self.cfg.lm.source_vocab}",
              f"data.train={d}/shards/new/train", f"data.eval={d}/shards/new/eval", f"data.tokenizer={d}/tokenizer",
              f"translator.kind={kind}", f"optim.lr={'null' if lr is None else lr}", f"train.steps={steps}",
              f"train.eval_every={eval_every}", *self._common(seed)]
        if start == "paper":
            ov += ["translator.init=uniform", "translator.source_marginal=uniform", "translator.floor=0",
                   "translator.alpha=0"]
        elif alpha is not None:
            ov += [f"translator.alpha={alpha}"]
        return Job(name, "translate", "configs/translate_olmo1b.yaml", ov, rd, f"{rd}/result.json",
                   consumes=[str(d)], produces=[f"{rd}/P.safetensors"])

    def finetune(self, name: str, kind: str, lr: float, seed: int, p_file: str = "", after: tuple[Job, ...] = (),
                 steps: int | None = None, embeddings_only: bool = False) -> Job:
        """`after`: the job that writes the P file; `steps`: None for ft_steps; `embeddings_only`: the body frozen
        (the ceiling probe)."""
        d, rd = self.p.data, str(self.p.runs / name)
        split = "source" if kind == "orig_tok" else "new"
        tok = self.p.model if kind == "orig_tok" else f"{d}/tokenizer"
        ov = [f"run_dir={rd}", f"model.path={self.p.model}", f"init.kind={kind}", f"init.p_file={p_file}",
              f"data.train={d}/shards/{split}/train", f"data.eval={d}/shards/{split}/eval", f"data.tokenizer={tok}",
              "engine.kind=plain", f"optim.lr={lr}", f"optim.weight_decay={self.cfg.ft_weight_decay}",
              f"train.steps={self.cfg.ft_steps if steps is None else steps}",
              f"train.eval_every={self.cfg.lm.ft_eval_every}", "train.keep_checkpoints=1", *self._common(seed)]
        if embeddings_only:
            ov.append("trainable=embeddings")
        return Job(name, "finetune", "configs/finetune_olmo1b.yaml", ov, rd, f"{rd}/result.json",
                   consumes=[str(d)] + ([p_file] if p_file else []), produces=[f"{rd}/final"],
                   upstream=upstream_of(*after))

    def evaluate(self, name: str, model: str, kind: str, p_file: str = "", role: tuple | None = None,
                 source_tokens: bool = False, after: tuple[Job, ...] = ()) -> Job:
        """Held-out score (fp32) of a model, or of the source model read through a P file. `source_tokens`: the
        model speaks the source model's tokenizer (FT orig. tok.); else the new BPE (an export carries it).
        `after`: the jobs that write the model or the P file."""
        rd = str(self.p.runs / name)
        own = kind in ("orig_tok", "as_is")  # the model directory's own tokenizer
        ov = [f"run_dir={rd}", f"output={rd}/eval.json", f"model.path={model}", f"init.kind={kind}",
              f"init.p_file={p_file}", f"eval.name={name.replace('/', '_')}",
              f"data.eval={self.p.heldout_source if source_tokens else self.p.heldout_new}",
              f"data.tokenizer={'' if own else str(self.p.data / 'tokenizer')}",
              f"eval.context_len={self.cfg.context_len}", f"eval.max_docs={self.cfg.eval_max_docs}", "engine.kind=plain",
              "eval.batch_size=8", "eval.precision=fp32"]
        cons = [str(self.p.data)] + ([p_file] if p_file else []) + ([model] if model.startswith(str(self.p.out))
                                                                     else [])
        return Job(name, "evaluate", "configs/evaluate_olmo1b.yaml", ov, rd, f"{rd}/eval.json", consumes=cons,
                   role=role, upstream=upstream_of(*after))

    # -- phases -----------------------------------------------------------------------------------------------
    def candidates(self, col: str) -> list[Arm]:
        """Every (start, alpha, step) a P column is selected from: S2T2 at the shipped alpha from the shipped start;
        S2T2 at the paper's alpha 0 from either start (the paper's start is alpha 0 by definition); the dense
        baselines from each of `lm.baseline_starts`, and (their *_fvt columns) from the shipped start alone."""
        kind = P_COLUMNS[col]
        grid = getattr(self.cfg.lm.p_lr_sweep, kind)
        if col.endswith("_fvt") or col == "s2t2":
            return [Arm(kind, "shipped", None, lr) for lr in grid]
        if col == "s2t2_a0":
            return [Arm(kind, start, 0.0, lr) for start in ("shipped", "paper") for lr in grid]
        return [Arm(kind, start, None, lr) for start in self.cfg.lm.baseline_starts for lr in grid]

    def columns(self) -> list[str]:
        lm = self.cfg.lm
        return [c for c in P_COLUMNS if (c != "s2t2_a0" or lm.s2t2_alpha0)
                and (not c.endswith("_fvt") or "shipped" in lm.baseline_starts)]

    def p_arm(self, arm: Arm, seed: int) -> Job:
        # the shipped start is the sparse kind's own, the paper's the baselines' first: only the other is tagged
        own = "shipped" if arm.kind == "sparse" else "paper"
        tag = ("" if arm.start == own else {"shipped": "_fvt", "paper": "_paper"}[arm.start]) + \
            ("_a0" if arm.alpha == 0 else "")
        return self.translate(f"seed{seed}/translate_{arm.kind}{tag}_{_lr_tag(arm.lr)}", arm.kind, arm.lr, seed,
                              self.cfg.p_steps, start=arm.start, alpha=arm.alpha)

    def ft_arm(self, kind: str, lr: float, seed: int, p_file: str = "", tag: str = "", after: tuple[Job, ...] = ()
               ) -> Job:
        return self.finetune(f"seed{seed}/ft_{tag or kind}_{_lr_tag(lr)}", kind, lr, seed, p_file, after)

    def start(self, seed: int) -> Job:
        """S2T2's start (the FVT start projected onto its marginals), 0 P-only steps: the P every S2T2 run starts
        from."""
        return self.translate(f"seed{seed}/translate_sparse_start", "sparse", None, seed, 0, start="shipped")

    def probe(self, lr: float) -> Job:
        """The P-only ceiling probe at step `lr`: S2T2's start with E' and L' then free (trainable=embeddings) on
        the frozen body, for the P-only budget (p_steps), seed 0."""
        s0 = self.cfg.seeds[0]
        st = self.start(s0)
        return self.finetune(f"seed{s0}/probe_embeddings_{_lr_tag(lr)}", "translated", lr, s0, st.produces[0],
                             after=(st,), steps=self.cfg.p_steps, embeddings_only=True)

    def curve(self) -> Job:
        from s2t2_dist.api import REGISTRY

        # at the automatic step; its rule is in the name, so that a record of another rule never stands for it
        # (the shipped start's marginal is its own, not uniform)
        c, rule = self.cfg, REGISTRY["sparse"].auto_tag(uniform_mu=False)
        return self.translate(f"seed{c.seeds[0]}/curve_s2t2_{rule}", "sparse", None, c.seeds[0], c.lm.curve_steps,
                              start="shipped", eval_every=c.lm.eval_every)

    def select_jobs(self) -> list[Job]:
        c, s0 = self.cfg, self.cfg.seeds[0]
        jobs = [self.curve()] if c.lm.curve_steps else []
        for col in self.columns():
            jobs += [self.p_arm(a, s0) for a in self.candidates(col)]
        for lr in c.lm.ft_lr_sweep:
            jobs += [self.ft_arm("new_tok_truncate", lr, s0, tag="new_tok"), self.ft_arm("orig_tok", lr, s0)]
        if c.lm.probe_lr_sweep:
            jobs += [self.start(s0), *(self.probe(lr) for lr in c.lm.probe_lr_sweep)]
        # the order of first use: the arms of the S2T2 start first, the baselines' other start last
        return sorted(jobs, key=lambda j: "_fvt_" in j.name)

    def ft_rows(self, chosen: dict[str, Arm]) -> list[str]:
        """The finetuned rows that can be built from `chosen` (a P + CFT row needs its P column's choice)."""
        return [r for r in FT_ROWS if r not in FT_P_ROW or FT_P_ROW[r] in chosen]

    def ft_row(self, row: str, chosen: dict[str, Arm], lr: float, seed: int) -> list[Job]:
        """One finetuned row at finetuning step `lr` on one seed: the P run it reads (if any), its finetune and the
        finetune's held-out score."""
        s = f"seed{seed}"
        pre: list[Job] = []
        if row in ("ft_orig_tok", "ft_new_tok"):
            kind = "orig_tok" if row == "ft_orig_tok" else "new_tok_truncate"
            ft = self.ft_arm(kind, lr, seed, tag="new_tok" if row == "ft_new_tok" else "")
        else:
            # the start-only row: S2T2's own start (0 P-only steps) finetuned the same way, so that a P + CFT row
            # minus it is what the learned P adds over the P it was learned from
            t = self.start(seed) if row == "fvt_start_cft" else self.p_arm(chosen[FT_P_ROW[row]], seed)
            tag = "cft_sparse_start" if row == "fvt_start_cft" else f"cft_{t.name.split('/translate_', 1)[1]}"
            ft = self.ft_arm("translated", lr, seed, t.produces[0], tag=tag, after=(t,))
            pre = [t]
        return pre + [ft, self.evaluate(f"{s}/eval_{ft.name.split('/ft_', 1)[1]}", ft.produces[0], "as_is",
                                        role=("table1", row, seed), source_tokens=row == "ft_orig_tok",
                                        after=(ft,))]

    def grid_jobs(self, chosen: dict[str, Arm]) -> list[Job]:
        """Seed 0: every finetuned row at every step of `lm.ft_lr_sweep`, each scored on validation (the choice of
        the row's own step) and held out (the bracket, reported)."""
        s0 = self.cfg.seeds[0]
        return [j for lr in self.cfg.lm.ft_lr_sweep for row in self.ft_rows(chosen)
                for j in self.ft_row(row, chosen, lr, s0)]

    def table_jobs(self, chosen: dict[str, Arm], ft_lrs: dict[str, float], probe_lr: float | None = None
                   ) -> list[Job]:
        """`ft_lrs`: each finetuned row's own step (a row without one has no jobs); `probe_lr`: the ceiling
        probe's chosen step (None: no probe row). Seed 0's finetunes are the grid's runs (same names, reused)."""
        jobs: list[Job] = []
        fvt = self.translate("refs/translate_fvt", "sparse", None, self.cfg.seeds[0], 0, start="shipped")
        fvt.overrides += ["translator.init=fvt", "translator.init_weight=1"]
        jobs += [fvt, self.evaluate("refs/eval_fvt", self.p.model, "translated", fvt.produces[0],
                                    role=("table1", "fvt", None), after=(fvt,))]
        # every name spells the choices (its P's start, alpha and step; the finetuning step); the rest of what an
        # arm is (steps, batch, what it read) is its spec, which a record must match (recipes/arm_records.py)
        for seed in self.cfg.seeds:
            s = f"seed{seed}"
            for col in (c for c in self.columns() if c in chosen):  # a report under way may lack a column
                t = self.p_arm(chosen[col], seed)
                jobs += [t, self.evaluate(f"{s}/eval_{t.name.split('/translate_', 1)[1]}", self.p.model,
                                          "translated", t.produces[0], role=("table1", col, seed), after=(t,))]
            for row in self.ft_rows(chosen):
                if ft_lrs.get(row) is not None:
                    jobs += self.ft_row(row, chosen, ft_lrs[row], seed)
            if seed == self.cfg.seeds[0]:  # the P-only rows' two ends: S2T2's start and the ceiling probe
                st = self.start(seed)
                jobs += [st, self.evaluate(f"{s}/eval_sparse_start", self.p.model, "translated", st.produces[0],
                                           role=("table1", "fvt_start", seed), after=(st,))]
                if probe_lr is not None:
                    pr = self.probe(probe_lr)
                    jobs += [pr, self.evaluate(f"{s}/eval_{pr.name.split('/', 1)[1]}", pr.produces[0], "as_is",
                                               role=("table1", "p_only_probe", seed), after=(pr,))]
        return jobs


# ----------------------------------------------------------------------------------------------------------------
# selection (validation split, seed 0)


def validation_bpb(job: Job) -> float | None:
    """The validation BpB a translate or finetune run reported at its end (its data.eval is the validation split)."""
    r = read_result(job)
    m = (r or {}).get("eval") or {}
    return m.get("bpb")


def _best(scores: dict[str, float | None]) -> tuple[float | None, bool]:
    """The step of the lowest score so far, and whether every candidate has run (only then is it a choice)."""
    done = {k: v for k, v in scores.items() if v is not None}
    return (float(min(done, key=done.get)) if done else None), len(done) == len(scores)


def select(plan: LmPlan) -> dict:
    """Each P column's (start, alpha, step), each finetuned row's own finetuning step and the ceiling probe's step,
    by validation BpB on seed 0; a choice is made only once every candidate has run (None until then), and a P +
    CFT row's step only once its P is chosen."""
    c, s0 = plan.cfg, plan.cfg.seeds[0]
    out: dict = {"criterion": "validation BpB at the end of the run (seed 0; the validation split of the training "
                              "data)", "p": {}, "ft": {}}
    chosen: dict = {}
    prov: dict = {}
    for col in plan.columns():
        scores = {a.label(): (a, validation_bpb(plan.p_arm(a, s0))) for a in plan.candidates(col)}
        for a in plan.candidates(col):  # how sparse each P ended, and how much of C still learned
            r = read_result(plan.p_arm(a, s0)) or {}
            if r:
                out.setdefault("p_end", {}).setdefault(col, {})[a.label()] = {
                    "sources_per_target": ((r.get("P") or {}).get("end") or {}).get("col_nnz_mean"),
                    "live_grad_frac": (r.get("gradient_on_C") or {}).get("live_grad_frac_at_end")}
        out["p"][col] = {k: v for k, (_, v) in scores.items()}
        done = [(v, a) for a, v in scores.values() if v is not None]
        best = min(done, key=lambda t: t[0])[1] if done else None
        chosen[col] = asdict(best) if len(done) == len(scores) else None
        if best is not None and not chosen[col]:  # for a report of a run still under way only: never run from
            prov[col] = asdict(best)
            out.setdefault("provisional_label", {})[col] = best.label()
        if chosen[col]:
            out.setdefault("chosen_label", {})[col] = Arm(**chosen[col]).label()
            grid = getattr(c.lm.p_lr_sweep, chosen[col]["kind"])
            if chosen[col]["lr"] in (min(grid), max(grid)):  # the optimum may lie outside: widen the grid
                out.setdefault("at_grid_edge", []).append(col)
    out["chosen"] = {"p": chosen, "ft_lr": {}}
    arms = {col: Arm(**(v or prov[col])) for col, v in chosen.items() if v or col in prov}
    lrs = c.lm.ft_lr_sweep
    for row in plan.ft_rows(arms):
        scores = {f"{lr:g}": validation_bpb(plan.ft_row(row, arms, lr, s0)[-2]) for lr in lrs}
        out["ft"][row] = scores
        best, complete = _best(scores)
        final = complete and (row not in FT_P_ROW or chosen.get(FT_P_ROW[row]) is not None)
        out["chosen"]["ft_lr"][row] = best if final else None
        if best is not None and not final:
            prov.setdefault("ft_lr", {})[row] = best
        if final and len(lrs) > 1 and best in (min(lrs), max(lrs)):
            out.setdefault("at_grid_edge", []).append(row)
    out["probe"] = {f"{lr:g}": validation_bpb(plan.probe(lr)) for lr in c.lm.probe_lr_sweep}
    best, complete = _best(out["probe"])
    out["chosen"]["probe_lr"] = best if complete else None
    if best is not None and not complete:
        prov["probe_lr"] = best
    lrs = c.lm.probe_lr_sweep
    if complete and best is not None and len(lrs) > 1 and best in (min(lrs), max(lrs)):
        out.setdefault("at_grid_edge", []).append("p_only_probe")
    if prov:
        out["provisional"] = prov
    return out


def report_choices(sel: dict) -> tuple[dict[str, Arm], dict[str, float], list[str]]:
    """The choices a report reads rows by: the selection's, or where a grid is still running, its best finished
    candidate so far (named in the third value, a finetuned row's step as "ft_lr:ROW": those rows may change; the
    run itself never uses them)."""
    prov = sel.get("provisional") or {}
    arms = {col: Arm(**(v or prov[col])) for col, v in sel["chosen"]["p"].items() if v or col in prov}
    ft_lrs = {row: lr for row, lr in sel["chosen"]["ft_lr"].items() if lr is not None}
    ft_lrs.update(prov.get("ft_lr") or {})
    names = sorted([k for k in prov if k != "ft_lr"] + [f"ft_lr:{r}" for r in prov.get("ft_lr") or {}])
    return arms, ft_lrs, names


# ----------------------------------------------------------------------------------------------------------------
# lanes


class Lanes:
    """Runs jobs in `n` parallel subprocess lanes, each job once its inputs exist; skips recorded jobs whose outputs
    nobody still needs; removes a finetune's checkpoints once it has finished."""

    def __init__(self, n: int, runner_factory, say=print):
        self.n, self.runner_factory, self.say = n, runner_factory, say
        self.history: list = []
        #: arms that a stop signal ended before their last step (each resumes from its last checkpoint)
        self.stopped: list[str] = []

    @staticmethod
    def needed(jobs: list[Job]) -> list[Job]:
        """Jobs to run: not recorded, or recorded but an unrecorded consumer reads an output that is missing."""
        need: list[Job] = []
        wanted: set[str] = set()
        for j in reversed(jobs):
            missing_outputs = any(p in wanted and not Path(p).exists() for p in j.produces)
            if read_result(j) is None or missing_outputs:
                need.append(j)
                wanted.update(j.consumes)
        return list(reversed(need))

    @staticmethod
    def _run_one(runner, job: Job):
        r = runner.run(job.stage, ["--config", str(REPO_ROOT / job.config), *job.overrides], job.run_dir,
                       job.name.replace("/", "_"), result_file=job.result, inputs=job.upstream)
        write_record(job)
        if job.stage == "finetune":
            # only a resume reads them, and a finished arm is never resumed: ~1.6 GB an arm at SmolLM2's size,
            # ~40 GB over a table (its export, which the scoring reads, stays)
            shutil.rmtree(Path(job.run_dir) / "checkpoints", ignore_errors=True)
        return r

    def _attempt(self, runner, job: Job, k: int) -> str:
        """Run one arm: "done", "failed" (said), or "stopped" (a stop signal ended it: checkpointed, resumable)."""
        from s2t2_dist.api import stop

        try:
            self.history.append(self._run_one(runner, job))
            return "done"
        except StageFailed as e:
            if stop.outside() is not None:
                return "stopped"
            self.say(f"[lane {k}] {job.name} FAILED: {str(e).splitlines()[0]}")
            return "failed"

    def run(self, jobs: list[Job], t0: float) -> list[str]:
        from s2t2_dist.api import stop

        todo = self.needed(jobs)
        # the same job (a selection run reused by the table) only once
        seen, queue = set(), []
        for j in todo:
            if j.name not in seen:
                seen.add(j.name)
                queue.append(j)
        producers = {p: j.name for j in queue for p in j.produces}
        done: set[str] = set()
        failed: list[str] = []
        running: set[str] = set()
        lock = threading.Condition()
        total = len(queue)
        started = time.time()

        def ready(j: Job) -> bool:
            return all(producers.get(c) in (None, j.name) or producers[c] in done for c in j.consumes)

        def lane(k: int) -> None:
            runner = self.runner_factory(k)
            while True:
                with lock:
                    while True:
                        if not queue or stop.outside() is not None:  # stopping: no new arm
                            return
                        blocked_by_failure = [j for j in queue if any(producers.get(c) in failed
                                                                      for c in j.consumes)]
                        for j in blocked_by_failure:
                            queue.remove(j)
                            failed.append(j.name)
                        nxt = next((j for j in queue if ready(j)), None)
                        if nxt is not None:
                            queue.remove(nxt)
                            running.add(nxt.name)
                            break
                        if not running:
                            return
                        lock.wait(timeout=5)
                n_done = len(done) + len(failed)
                eta = ""
                if done:
                    rate = (time.time() - started) / len(done)
                    eta = f", about {fmt_seconds(rate * (total - n_done) / self.n)} left"
                self.say(f"[lane {k}] [{n_done + len(running)}/{total}] {nxt.name}: {nxt.stage}"
                         f"   (t = {fmt_seconds(time.time() - t0)}{eta})")
                outcome = "failed"
                try:
                    outcome = self._attempt(runner, nxt, k)
                finally:  # whatever happened, the job leaves `running`: the other lanes never wait on it
                    with lock:
                        running.discard(nxt.name)
                        {"done": done.add, "failed": failed.append, "stopped": self.stopped.append}[outcome](nxt.name)
                        lock.notify_all()

        threads = [threading.Thread(target=lane, args=(k,), daemon=True) for k in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return failed


# ----------------------------------------------------------------------------------------------------------------
# data and references


def prepare_lm_data(out: Path, cfg: ReproduceConfig, model: str, progress: bool = False) -> tuple[LmPaths, dict]:
    from s2t2_dist.api import DataConfig
    from s2t2_dist.api import prepare
    from s2t2_dist.api import tokenize_files
    from s2t2_dist.recipes.protein_corpus import build_corpus

    data = out / "data"
    corpus = build_corpus(data / "corpus", heldout_fraction=cfg.lm.heldout_fraction)
    dc = DataConfig(inputs=[str(data / "corpus" / "trainval.fasta")], format="fasta", domain="protein",
                    extra_residue_policy="keep", eval_fraction=VALIDATION_FRACTION, split_by="text",
                    seed=VALIDATION_SEED, vocab_size=cfg.vocab_size, tokenizer_max_records=None,
                    source_tokenizer=model, context_len=cfg.context_len, shard_size=256, num_workers=0,
                    output_dir=str(data / "prepared"))
    summary = prepare(dc, progress=progress)
    held = str(data / "corpus" / "heldout.fasta")
    cache = data / "heldout_shards"
    new = tokenize_files([held], str(data / "prepared" / "tokenizer"), cache_dir=cache, format="fasta",
                         on_bad_record="error", progress=progress)
    src = tokenize_files([held], model, cache_dir=cache, format="fasta", on_bad_record="error", progress=progress)
    paths = LmPaths(out=out, model=model, data=data / "prepared", heldout_new=new["eval_dir"],
                    heldout_source=src["eval_dir"])
    return paths, {"corpus": corpus, "prepare": _prepare_summary(summary),
                   "heldout_records": {"new": new["records"], "source": src["records"]}}


def _prepare_summary(summary: dict) -> dict:
    sp = summary.get("split") or {}
    comp = ((summary.get("tokenizer") or {}).get("compression") or {}).get("tokenizers", {})
    return {"train_records": sp.get("train_records"), "validation_records": sp.get("eval_records"),
            "train_chars": sp.get("train_chars"), "validation_chars": sp.get("eval_chars"),
            "bytes_per_token": {k: v.get("bytes_per_token") for k, v in comp.items()}}


def residue_frequencies(train_texts: list[str], alphabet) -> dict[str, float]:
    """Add-one smoothed letter frequencies of the train texts over ``alphabet`` (a superset of their letters)."""
    from collections import Counter

    counts = Counter("".join(train_texts))
    total = sum(counts[a] for a in alphabet) + len(alphabet)
    return {a: (counts[a] + 1) / total for a in alphabet}


def residue_unigram(train_texts: list[str], scored_texts: list[str]) -> dict:
    """Bits per byte of the train split's residue frequencies (add-one smoothed) on other sequences: a model that
    knows only how common each amino acid is (one byte per residue)."""
    import math
    from collections import Counter

    scored: Counter = Counter()
    for t in scored_texts:
        scored.update(t.upper())
    p = residue_frequencies(train_texts, set("".join(train_texts)) | set(scored))
    n_bytes = sum(scored.values())
    nll = -sum(n * math.log(p[a]) for a, n in scored.items())
    return {"bpb": nll / (math.log(2) * n_bytes), "letters": len(p), "bytes": n_bytes}


#: prior strengths (pseudo-counts) the adaptive unigram is chosen among, on the validation split
ADAPTIVE_STRENGTHS = (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def adaptive_unigram(train_texts: list[str], scored_texts: list[str], strength: float) -> dict:
    """Bits per byte of an in-sequence adaptive unigram: each residue predicted from the train split's letter
    frequencies (add-one smoothed) as a prior of ``strength`` pseudo-counts, plus the counts of the letters already
    read in the same sequence (a Dirichlet-multinomial: a sequence's own composition takes over as it is read).
    Training-free: what a model gets from one sequence's composition alone."""
    import math
    from collections import Counter

    letters = set("".join(train_texts)) | set("".join(t.upper() for t in scored_texts))
    prior = residue_frequencies(train_texts, letters)
    nll, n = 0.0, 0
    for t in scored_texts:
        seen: Counter = Counter()
        for k, a in enumerate(t.upper()):
            nll -= math.log((strength * prior[a] + seen[a]) / (strength + k))
            seen[a] += 1
        n += len(t)
    return {"bpb": nll / (math.log(2) * n), "letters": len(letters), "bytes": n, "strength": strength}


def references(paths: LmPaths) -> dict:
    """The training-free lines, on the held-out split (the table's) and on the validation split (the curve's)."""
    from s2t2_dist.api import read_fasta
    from s2t2_dist.api import iter_split_texts
    from s2t2_dist.recipes.orchestrate import unigram_reference

    splits = paths.data / "splits"
    train = list(iter_split_texts(splits, "train"))
    held = [r.text for r in read_fasta(paths.out / "data" / "corpus" / "heldout.fasta")]
    new = paths.data / "shards" / "new"
    val = list(iter_split_texts(splits, "eval"))
    # the adaptive unigram's one setting, its prior's strength, chosen on the validation split (its best shot)
    by = {s: adaptive_unigram(train, val, s) for s in ADAPTIVE_STRENGTHS}
    best = min(by, key=lambda s: by[s]["bpb"])
    return {"unigram_bpe": unigram_reference(new / "train", paths.heldout_new),
            "residue_unigram": residue_unigram(train, held), "adaptive_unigram": adaptive_unigram(train, held, best),
            "validation": {"unigram_bpe": unigram_reference(new / "train", new / "eval"),
                           "residue_unigram": residue_unigram(train, val), "adaptive_unigram": by[best],
                           "adaptive_unigram_by_strength": {f"{s:g}": v["bpb"] for s, v in by.items()}}}


# ----------------------------------------------------------------------------------------------------------------
# entry


def _table_plan(plan: LmPlan):
    """The selection so far, the seed-0 finetuning grid and the table they give: by the selection's choices once
    they are made (run then), else by the best so far (reported only)."""
    sel = select(plan)
    arms, ft_lrs, provisional = report_choices(sel)
    probe_lr = sel["chosen"].get("probe_lr") or (sel.get("provisional") or {}).get("probe_lr")
    return sel, plan.grid_jobs(arms), plan.table_jobs(arms, ft_lrs, probe_lr), arms, provisional


@contextmanager
def _stop_passed_on(say):
    """While the lanes run: SIGINT, SIGTERM and SIGUSR1 to the command ask every arm under way to checkpoint and
    stop (stage processes: the signal passed on; a stage in a lane thread: utils/stop.request, read by its loop at
    the next step) and the lanes to take no new arm. A second Ctrl-C stops at once (KeyboardInterrupt)."""
    import signal

    from s2t2_dist.recipes.orchestrate import signal_children
    from s2t2_dist.api import stop

    def handler(signum, frame):
        if stop.outside() is not None:
            if signum == signal.SIGINT:
                signal_children(signal.SIGINT)
                raise KeyboardInterrupt
            return
        stop.request(signum)
        signal_children(signum)
        say(f"{signal.Signals(signum).name} received: the arms under way stop at their next checkpoint (a score "
            "finishes first); no new arm starts")

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    old = {s: signal.signal(s, handler) for s in sigs} if threading.current_thread() is threading.main_thread() \
        else {}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_smollm2(cfg: ReproduceConfig, out: Path, *, cache: Path | None = None, echo: bool = False,
                phase: str = "all", records: list[Path] | None = None, say=print) -> dict:
    """Run the phases up to `phase` (select | all; report: run nothing) and write the outputs from every finished
    arm."""
    from s2t2_dist.api import save_config
    from s2t2_dist.recipes.reproduce_lm_report import write_outputs
    from s2t2_dist.recipes.smollm2 import smollm2
    from s2t2_dist.api import stop
    from s2t2_dist.api import atomic_write_json

    t0 = time.time()
    stop.request(None)
    EXTRA_RECORDS[:] = [Path(r) for r in records or []]
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "reproduce_config.yaml")
    say(f"S2T2 reproduction, scale {cfg.scale} -> {out}\n  seeds {cfg.seeds}, P {cfg.p_steps} steps, finetuning "
        f"{cfg.ft_steps} steps, batch {cfg.batch_size} x {cfg.context_len}, source {cfg.lm.source_vocab}, "
        f"{cfg.lm.lanes} lane(s), {training_precision(cfg.lm.precision)}")
    if phase != "report":
        for line in precision_warning(cfg.lm.precision):
            say(line)
    lanes: Lanes | None = None
    failed: list[str] = []
    with _stop_passed_on(say):  # a stop during the preparation: it completes, then no arm starts
        model = cfg.lm.model or str(smollm2(cache, log=lambda m: say("  " + m)))
        paths, data_info = prepare_lm_data(out, cfg, model)
        say(f"[data] {data_info['corpus']['unique']} unique sequences: "
            f"{data_info['prepare']['train_records']} train, {data_info['prepare']['validation_records']} "
            f"validation, {data_info['corpus']['heldout']['sequences']} held out")
        refs = references(paths)
        atomic_write_json(out / "references.json", {**refs, "data": data_info})
        plan = LmPlan(cfg, paths)
        threads = max(1, (os.cpu_count() or 1) // cfg.lm.lanes)

        def runner(k: int) -> Runner:
            # one lane runs the stages in this process (no start-up per arm); lanes are processes of their own
            return Runner(ranks=1, in_process=cfg.lm.lanes == 1, log_dir=out / "logs", echo=echo, root=out,
                          env={"OMP_NUM_THREADS": str(threads), "S2T2_LOG_LEVEL": "INFO"})

        lanes = Lanes(cfg.lm.lanes, runner, say=say)
        if phase != "report":
            failed = lanes.run(plan.select_jobs(), t0)
        sel, grid, jobs, arms, provisional = _table_plan(plan)
        p_ready = not [k for k in provisional if not k.startswith("ft_lr")] and len(arms) == len(plan.columns())
        if p_ready and phase == "all" and not failed and not lanes.stopped:
            # seed 0's finetuning grid (each row's own step), then the table at those steps
            failed = lanes.run(grid, t0)
            sel, grid, jobs, arms, provisional = _table_plan(plan)
            if not provisional and not failed and not lanes.stopped:
                failed = lanes.run(jobs, t0)
    sig = stop.outside()
    if sig is not None:
        # a stop signal: the arms under way checkpointed; the report waits for a run that ends by itself
        stop.request(None)
        return {"stopped": lanes.stopped, "signal": sig, "failed": failed}
    atomic_write_json(out / "selection.json", sel)
    say("[select] " + json.dumps(sel["chosen"]))
    from s2t2_dist.recipes.reproduce_lm_report import collect

    results = collect(plan, jobs, sel, refs, grid=grid,
                      extra={"config": asdict(cfg), "data": data_info, "failed": failed, "provisional": provisional,
                             "seconds": round(time.time() - t0, 1)})
    for k, p in write_outputs(results, out).items():
        say(f"  {k:<12} {p}")
    return results
