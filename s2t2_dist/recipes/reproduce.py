"""`s2t2 reproduce --scale tiny|small|smollm2|paper`: the paper's Table 1 and its transfer experiment (Figure 2).

    s2t2 reproduce --scale tiny                    # CI-sized: minutes on a CPU
    s2t2 reproduce --scale small --out runs/small  # ~12 min on 2 shared CPU cores (11.6 measured); results: BENCHMARKS.md
    s2t2 reproduce --scale small seeds=[0,1] p_steps=200 alphas=[0,0.1]     # any key of ReproduceConfig
    s2t2 reproduce --scale smollm2 --out runs/smollm2 --quiet   # Table 1 with a real pretrained LM (SmolLM2-135M)
                                                   # on real proteins: hours on a CPU, resumable; recipes/reproduce_lm.py
    s2t2 reproduce --scale paper                   # PRINTS the SLURM submissions (OLMo-1B/7B, UniRef50)
    s2t2 reproduce --scale paper --collect runs/paper   # afterwards: the same table/plots from the cluster's runs

Table 1 columns (each with the same step budget: `p_steps` for learning P, `ft_steps` for finetuning):
  Plain P (translator kind unconstrained), Sinkhorn P (softmax), S2T2 (sparse), each evaluated as learned
  (frozen LM) and after continued finetuning (+ CFT); FT orig. tok. (the source model finetuned on shards made with
  its own tokenizer); FT new tok. (the new tokenizer with E and L truncated to its u rows).
Transfer: P learned on the SMALL source model with several entropy weights alpha (loss + alpha H(P)) is applied,
without finetuning, to a LARGER model with the same source vocabulary; against New Tok. (truncated E/L), Orig Tok.
and the random-guess line ln u.

Local scales (tiny, small) use two real byte-level English LMs pretrained here on the shipped Shakespeare text by
`models.pretrain_english` (same recipe and byte vocabulary; the larger one wider and trained longer; the paper's
source tokens are bytes too) and the shipped protein sample; the LMs are cached under `--cache` (default
OUT/source_lm). The target BPE has u = 256 tokens locally (<= the byte LMs' 264 embedding rows, so that the
new-tok truncation baseline exists).

Hyperparameters: the paper's (P lr 1e-3, finetuning lr 2e-5, transfer P lr 2e-5, 2000 steps) at the paper scale.
The local scales train tiny models for tens to hundreds of steps, so they finetune at lr 1e-3 and, with
`p_lr_sweep`, give each translator the P learning rate with its lowest final TRAINING loss (the translators' C
parametrisations differ by orders of magnitude in how far one Adam step moves P). Reference lines: the random guess
ln u and a unigram model (the train split's token frequencies) of each tokenizer.

Every stage run is a real `translate` / `finetune` / `evaluate` run (1 rank: in this process; `--ranks N`:
torchrun) from the shipped configs plus dotted overrides; a rerun reuses finished runs. Outputs in OUT:
results.json, table1.md, report.md, plots/*.png, runs/ (each run's config, TensorBoard logs, result).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from s2t2_dist.api import load_config
from s2t2_dist.api import ConfigError
from s2t2_dist.recipes.orchestrate import REPO_ROOT, Runner, StageFailed, fmt_seconds
from s2t2_dist.recipes.paper_plan import (  # noqa: F401 (KINDS, TABLE1, PAPER_TABLE1: the plan's public names)
    KINDS,
    PAPER_TABLE1,
    TABLE1,
    Job,
    ReproduceConfig,
    Setting,
    alpha_tag,
    preset,
)


def _data_overrides(d: str, source: bool = False) -> list[str]:
    split = "source" if source else "new"
    return [f"data.train={d}/shards/{split}/train", f"data.eval={d}/shards/{split}/eval"]


def _train_overrides(cfg: ReproduceConfig, st: Setting) -> list[str]:
    train = [f"train.batch_size={cfg.batch_size}", f"train.context_len={cfg.context_len}",
             f"train.log_every={cfg.log_every}", f"train.eval_max_docs={cfg.eval_max_docs}"]
    if st.local:
        train += ["train.ckpt_every=0", "train.eval_every=0", f"train.micro_batch_size={cfg.batch_size}",
                  "data.num_workers=0"]
    return train


def translate_job(cfg: ReproduceConfig, st: Setting, name: str, kind: str, alpha: float | None,
                  lr: float | None, seed: int, steps: int | None = None, extra: tuple[str, ...] = (),
                  recipe: str = "paper") -> Job:
    """Stage 1 on the small source model: learn P of `kind` with entropy weight `alpha` (None: the config's) at
    `lr` (absolute; None: the kind's default). recipe paper: the paper's literal recipe, whatever the config's
    start (configs/translate_paper.yaml's translator keys): C = 1/v (init uniform), no weight floor; default: the
    config's (the shipped) recipe."""
    d = st.data
    rd = f"{st.out}/{name}"
    paper = ("translator.init=uniform", "translator.floor=0") if recipe == "paper" else ()
    ov = [f"run_dir={rd}", f"model.path={st.small_model}", *_data_overrides(d), f"data.tokenizer={d}/tokenizer",
          f"translator.kind={kind}", *([f"translator.alpha={alpha}"] if alpha is not None else []),
          f"optim.lr={'null' if lr is None else lr}",
          f"train.steps={cfg.p_steps if steps is None else steps}", f"train.seed={seed}", *_train_overrides(cfg, st),
          *paper, *extra]
    if st.local:
        # evaluated by the evaluate stage; the local byte LMs' vocabulary is bytes plus their specials, so `all`
        # (the config's single_byte would drop the BOS/EOS rows the documents start and end with)
        ov += ["data.eval=", "translator.heatmap=[64,64]", "model.source_vocab=all"]
    return Job(name, "translate", "configs/translate_olmo1b.yaml", ov, rd, f"{rd}/result.json",
               consumes=[d], produces=[f"{rd}/P.safetensors"], script="slurm/translate_1b.sh")



def sweep_plan(cfg: ReproduceConfig, st: Setting) -> list[Job]:
    """The P learning-rate selection runs: every translator kind x every lr of p_lr_sweep, first seed."""
    return [translate_job(cfg, st, f"lr_sweep/{kind}_lr{lr:g}", kind, 0.0, lr, cfg.seeds[0])
            for kind in KINDS.values() for lr in cfg.p_lr_sweep]


def final_train_loss(run_dir: str | Path) -> float:
    """Mean training loss over the last quarter of a run's logged steps (TensorBoard train/loss)."""
    from s2t2_dist.recipes.orchestrate import tb_scalars

    pts = tb_scalars(Path(run_dir) / "tb" / "global", "train/loss")
    if not pts:
        return float("nan")
    tail = [v for _, v in pts[-max(1, len(pts) // 4):]]
    return sum(tail) / len(tail)


def select_lrs(cfg: ReproduceConfig, jobs: list[Job]) -> dict:
    """Per translator kind: the sweep's lr with the lowest final TRAINING loss (no held-out data involved)."""
    table: dict[str, dict[str, float]] = {}
    for j in jobs:
        kind = next(o.split("=", 1)[1] for o in j.overrides if o.startswith("translator.kind="))
        lr = float(next(o.split("=", 1)[1] for o in j.overrides if o.startswith("optim.lr=")))
        table.setdefault(kind, {})[f"{lr:g}"] = final_train_loss(j.run_dir)
    chosen = {k: float(min((v for v in t.items() if math.isfinite(v[1])), key=lambda kv: kv[1])[0])
              for k, t in table.items()}
    return {"criterion": "mean training loss over the last quarter of the logged steps (first seed)",
            "final_train_loss": table, "chosen": chosen}


def transfer_lr(cfg: ReproduceConfig, p_lrs: dict[str, float]) -> float:
    return cfg.transfer_p_lr if cfg.transfer_p_lr is not None else p_lrs["sparse"]


def build_plan(cfg: ReproduceConfig, st: Setting, p_lrs: dict[str, float] | None = None) -> list[Job]:  # noqa: C901 - one job per arm of the paper's table
    """Every stage run of the reproduction, in an order that respects their inputs. `p_lrs`: P learning rate per
    translator kind (default: cfg.p_lr for all)."""
    p_lrs = p_lrs or {k: cfg.p_lr for k in KINDS.values()}
    t_lr = transfer_lr(cfg, p_lrs)
    d, out = st.data, st.out
    tok = f"{d}/tokenizer"
    jobs: list[Job] = []
    train = _train_overrides(cfg, st)
    evalo = [f"eval.context_len={cfg.context_len}", f"eval.max_docs={cfg.eval_max_docs}"]
    if st.local:
        evalo += ["engine.kind=plain", "eval.batch_size=16"]
    new_data = _data_overrides(d) + [f"data.tokenizer={tok}"]
    if not st.local:
        jobs.append(Job("prepare", "prepare", "configs/prepare_uniref50.yaml",
                        [f"output_dir={d}", f"vocab_size={cfg.vocab_size}", f"context_len={cfg.context_len}",
                         f"source_tokenizer={st.source_tokenizer}"],
                        d, f"{d}/prepare_summary.json", produces=[d], script="slurm/prepare_data.sh"))

    def evaluate(name, model, kind, p_file="", source=False, role=None, config="configs/evaluate_olmo1b.yaml"):
        rd = f"{out}/{name}"
        ov = [f"run_dir={rd}", f"output={rd}/eval.json", f"model.path={model}", f"init.kind={kind}",
              f"init.p_file={p_file}", f"eval.name={name.replace('/', '_')}", *evalo]
        if source:
            ov += [f"data.eval={d}/shards/source/eval", "data.tokenizer="]
        else:
            ov += [f"data.eval={d}/shards/new/eval", f"data.tokenizer={tok}"]
        cons = [d] + ([p_file] if p_file else []) + ([model] if model.startswith(out) else [])
        return Job(name, "evaluate", config, ov, rd, f"{rd}/eval.json", consumes=cons, script="slurm/evaluate.sh",
                   role=role)

    def finetune(name, kind, seed, p_file="", role=None):
        rd = f"{out}/{name}"
        ov = [f"run_dir={rd}", f"model.path={st.small_model}", f"init.kind={kind}", f"init.p_file={p_file}",
              f"optim.lr={cfg.ft_lr}", f"optim.weight_decay={cfg.ft_weight_decay}", f"train.steps={cfg.ft_steps}",
              f"train.seed={seed}", *train]
        if kind == "orig_tok":
            ov += _data_overrides(d, source=True) + [f"data.tokenizer={st.source_tokenizer}"]
        else:
            ov += new_data
        if st.local:
            ov += ["engine.kind=plain"]
        return Job(name, "finetune", "configs/finetune_olmo1b.yaml", ov, rd, f"{rd}/result.json",
                   consumes=[d] + ([p_file] if p_file else []), produces=[f"{rd}/final"],
                   script="slurm/finetune_7b.sh", role=role)

    for seed in cfg.seeds:
        s = f"seed{seed}"
        p_files = {}
        for method, kind in KINDS.items():
            j = translate_job(cfg, st, f"{s}/translate_{kind}", kind, 0.0, p_lrs[kind], seed)
            jobs.append(j)
            p_files[method] = j.produces[0]
        transfer_p = {}
        for a in cfg.alphas:
            if a == 0 and t_lr == p_lrs["sparse"]:
                transfer_p[a] = p_files["s2t2"]
                continue
            j = translate_job(cfg, st, f"{s}/translate_sparse_transfer_{alpha_tag(a)}", "sparse", a, t_lr, seed)
            jobs.append(j)
            transfer_p[a] = j.produces[0]
        # the training-free FVT baseline: the surface-string start (translator.init=fvt, init_weight 1) as the
        # translate stage builds and exports it, untrained (train.steps=0: the lr is never used)
        j = translate_job(cfg, st, f"{s}/translate_fvt", "sparse", 0.0, cfg.p_lr, seed, steps=0,
                          extra=("translator.init=fvt", "translator.init_weight=1"))
        jobs.append(j)
        jobs.append(evaluate(f"{s}/eval_fvt", st.small_model, "translated", j.produces[0],
                             role=("table1", "fvt", seed)))
        # S2T2 with the shipped recipe (the flagship config's translator section: FVT start, entropy weight, the
        # kind's default lr; docs/translator.md), next to the paper-faithful S2T2 column (recipe paper)
        j = translate_job(cfg, st, f"{s}/translate_s2t2_default", "sparse", None, None, seed, recipe="default")
        jobs.append(j)
        jobs.append(evaluate(f"{s}/eval_s2t2_default", st.small_model, "translated", j.produces[0],
                             role=("table1", "s2t2_default", seed)))
        for method in KINDS:  # P only: the frozen small model read through the learned P
            jobs.append(evaluate(f"{s}/eval_{method}", st.small_model, "translated", p_files[method],
                                 role=("table1", method, seed)))
        for method in KINDS:  # + CFT
            jobs.append(finetune(f"{s}/ft_{method}_cft", "translated", seed, p_files[method],
                                 role=("table1", f"{method}_cft", seed)))
        jobs.append(finetune(f"{s}/ft_orig_tok", "orig_tok", seed, role=("table1", "ft_orig_tok", seed)))
        jobs.append(finetune(f"{s}/ft_new_tok", "new_tok_truncate", seed, role=("table1", "ft_new_tok", seed)))
        for a in cfg.alphas:  # transfer: P of the small model, large model, no finetuning
            jobs.append(evaluate(f"{s}/transfer_s2t2_{alpha_tag(a)}", st.large_model, "translated", transfer_p[a],
                                 role=("transfer", f"s2t2_{alpha_tag(a)}", seed),
                                 config="configs/evaluate_transfer_7b.yaml"))
    # the transfer baselines train nothing: one run, whatever the seed
    jobs.append(evaluate("transfer/new_tok", st.large_model, "new_tok_truncate", role=("transfer", "new_tok", None),
                         config="configs/evaluate_transfer_7b.yaml"))
    jobs.append(evaluate("transfer/orig_tok", st.large_model, "orig_tok", source=True,
                         role=("transfer", "orig_tok", None), config="configs/evaluate_transfer_7b.yaml"))
    return jobs


# ----------------------------------------------------------------------------------------------------------------
# paper scale: SLURM submissions, printed and validated


PAPER_OUT = "runs/paper"
PAPER_DATA = "data/uniref50"
OLMO_1B, OLMO_7B = "allenai/OLMo-1B-hf", "allenai/OLMo-7B-hf"


def paper_setting(out: str = PAPER_OUT) -> Setting:
    return Setting(out=out, data=PAPER_DATA, small_model=OLMO_1B, large_model=OLMO_7B, source_tokenizer=OLMO_1B,
                   local=False)


def _var(name: str) -> str:
    return "J_" + "".join(c if c.isalnum() else "_" for c in name)


def paper_commands(jobs: list[Job]) -> list[str]:
    """One `sbatch` line per job (S2T2_CONFIG selects the shipped config, dotted overrides follow), chained by
    --dependency=afterok on the jobs whose outputs it reads."""
    producer = {p: j for j in jobs for p in j.produces}
    lines = []
    for j in jobs:
        deps = sorted({_var(producer[c].name) for c in j.consumes if c in producer and producer[c] is not j})
        dep = f" --dependency=afterok:{':'.join('$' + v for v in deps)}" if deps else ""
        extra = "".join(" " + shlex.quote(x) for x in j.sbatch)
        args = " ".join(shlex.quote(o) for o in j.overrides)
        lines.append(f"{_var(j.name)}=$(S2T2_CONFIG={j.config} sbatch --parsable --job-name=s2t2-{j.name.replace('/', '-')}"
                     f"{dep}{extra} {j.script} {args})")
    return lines


def paper_script(cfg: ReproduceConfig, jobs: list[Job]) -> str:
    head = [
        "#!/bin/bash",
        "# S2T2 at the paper's scale: OLMo-1B (Table 1, P learned for the transfer) and OLMo-7B (transfer), UniRef50.",
        "# Generated by `s2t2 reproduce --scale paper`. Run from the repository root on the SLURM cluster; every job",
        "# checkpoints and requeues itself (slurm/common.sh). Raw data first: data/raw/uniref50.fasta.gz.",
        f"# Seeds {cfg.seeds}; P: {cfg.p_steps} steps, lr {cfg.p_lr:g} (transfer runs: lr "
        f"{transfer_lr(cfg, {'sparse': cfg.p_lr}):g}, "
        f"alphas {cfg.alphas}); finetuning: {cfg.ft_steps} steps, lr {cfg.ft_lr:g}; batch {cfg.batch_size} x "
        f"{cfg.context_len} tokens.",
        f"# When every job has finished: s2t2 reproduce --scale paper --collect {PAPER_OUT}",
        "set -euo pipefail",
    ]
    return "\n".join(head + paper_commands(jobs)) + "\n"


def _stage_config_class(stage: str):
    if stage == "prepare":
        from s2t2_dist.api import DataConfig

        return DataConfig
    if stage == "translate":
        from s2t2_dist.api import TranslateConfig

        return TranslateConfig
    if stage == "finetune":
        from s2t2_dist.api import FinetuneConfig

        return FinetuneConfig
    from s2t2_dist.api import EvaluateConfig

    return EvaluateConfig


def validate_plan(jobs: list[Job], cluster_inputs: tuple[str, ...] = ("data/raw/",)) -> list[str]:
    """Problems of a paper-scale plan (empty: valid): the batch scripts and configs exist, each job's config loads
    through the config system with its overrides (the stage's own argument handling), every path a job reads is
    written by an earlier job (or is a raw input on the cluster), and every run directory is distinct."""
    problems: list[str] = []
    produced: set[str] = set()
    run_dirs: dict[str, str] = {}
    for j in jobs:
        where = f"{j.name} ({j.stage})"
        for f in (j.script, j.config):
            if not (REPO_ROOT / f).is_file():
                problems.append(f"{where}: {f} does not exist")
        if j.run_dir in run_dirs:
            problems.append(f"{where}: run directory {j.run_dir} is also {run_dirs[j.run_dir]}'s")
        run_dirs[j.run_dir] = j.name
        try:
            _load_stage_config(j)
        except ConfigError as e:
            problems.append(f"{where}: {e}")
        for c in j.consumes:
            if c not in produced and not c.startswith(cluster_inputs) and c not in (OLMO_1B, OLMO_7B):
                problems.append(f"{where}: reads {c}, which no earlier job writes")
        produced.update(j.produces)
    return problems


def _load_stage_config(j: Job):
    cls = _stage_config_class(j.stage)
    path = REPO_ROOT / j.config
    if j.stage in ("finetune", "evaluate"):  # their entry points translate launcher arguments first
        from s2t2_dist.api import engine_overrides

        overrides = engine_overrides(list(j.overrides))
    else:
        overrides = list(j.overrides)
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)  # config paths (ds_config, ...) are repository-relative, as on the cluster
    try:
        return load_config(cls, path, overrides)
    except ConfigError as e:
        # the raw UniRef50 file exists only on the cluster: accept exactly that error
        if j.stage == "prepare" and "inputs:" in str(e) and "does not exist" in str(e):
            return None
        raise
    finally:
        os.chdir(cwd)


# ----------------------------------------------------------------------------------------------------------------
# local scales: prepare, source LMs, then every job in order


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def run_local(cfg: ReproduceConfig, out: Path, *, ranks: int = 1, cache: Path | None = None, echo: bool = True
              ) -> dict:
    from s2t2_dist.recipes.orchestrate import english_bytes, prepare_protein
    from s2t2_dist.recipes.reproduce_report import collect, write_outputs
    from s2t2_dist.api import atomic_write_json

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    from s2t2_dist.api import save_config

    save_config(cfg, out / "reproduce_config.yaml")
    cache = cache or out / "source_lm"
    timings: dict[str, float] = {}
    _say(f"S2T2 reproduction, scale {cfg.scale} -> {out}\n  seeds {cfg.seeds}, P {cfg.p_steps} steps, finetuning "
         f"{cfg.ft_steps} steps, batch {cfg.batch_size} x {cfg.context_len}, alphas {cfg.alphas}, {ranks} rank(s)")

    _say("\n[source LMs] two byte-level English LMs (same recipe and byte vocabulary, two sizes) on the shipped text")
    t = time.time()
    sources = {}
    for key in ("small", "large"):
        recipe = asdict(getattr(cfg, key))
        path, info = english_bytes(cache, log=lambda m: _say("  " + m), **recipe)
        sources[key] = {"path": str(path), "recipe": recipe, "val_loss": info.get("val_loss_after"),
                        "seconds": info.get("seconds"),
                        "val_bpb": info.get("val_bpb_after"), "params": _n_params(path)}
        _say(f"  {key}: {path.name} ({sources[key]['params']:,} parameters), English validation loss "
             f"{info.get('val_loss_after', float('nan')):.3f} nats/byte")
    timings["source_lms"] = round(time.time() - t, 1)
    timings["source_lms_compute"] = round(sum(float(s.get("seconds") or 0) for s in sources.values()), 1)

    _say("\n[data] the shipped protein sample -> BPE + shards (new tokenizer and the source LMs' byte tokenizer)")
    t = time.time()
    data = out / "data"
    summary = prepare_protein(data, vocab_size=cfg.vocab_size, context_len=cfg.context_len,
                              source_tokenizer=sources["small"]["path"], progress=False)
    timings["prepare"] = round(time.time() - t, 1)
    st = Setting(out=str(out / "runs"), data=str(data), small_model=sources["small"]["path"],
                 large_model=sources["large"]["path"], source_tokenizer=sources["small"]["path"])
    runner = Runner(ranks=ranks, log_dir=out / "logs", echo=echo, root=out)
    t = time.time()
    extra: dict = {}
    p_lrs = None
    if cfg.p_lr_sweep:
        sweep = sweep_plan(cfg, st)
        _say(f"\n[lr selection] P learning rate per translator among {cfg.p_lr_sweep}, by final training loss")
        _run_jobs(runner, sweep, t0)
        sel = select_lrs(cfg, sweep)
        p_lrs = sel["chosen"]
        extra["lr_selection"] = sel
        _say("  chosen: " + ", ".join(f"{k} {v:g}" for k, v in p_lrs.items()))
    jobs = build_plan(cfg, st, p_lrs)
    atomic_write_json(out / "plan.json", [asdict(j) for j in jobs])
    extra["p_lr_by_kind"] = p_lrs or {k: cfg.p_lr for k in KINDS.values()}
    extra["transfer_p_lr_used"] = transfer_lr(cfg, extra["p_lr_by_kind"])
    _run_jobs(runner, jobs, t0)
    timings["runs"] = round(time.time() - t, 1)
    timings["runs_compute"] = round(sum(r.seconds for r in runner.history), 1)  # incl. reused runs' first time
    timings["total"] = round(time.time() - t0, 1)
    from s2t2_dist.recipes.orchestrate import unigram_reference

    extra["unigram"] = {split: unigram_reference(data / "shards" / split / "train", data / "shards" / split / "eval")
                        for split in ("new", "source")}
    results = collect(cfg, jobs, st, extra={"sources": sources, "data_summary": _data_summary(summary),
                                            "ranks": ranks, "seconds": timings, **extra})
    paths = write_outputs(results, out)
    _say(f"\nDone in {fmt_seconds(timings['total'])}.")
    for k, p in paths.items():
        _say(f"  {k:<12} {p}")
    _say(f"  tensorboard  tensorboard --logdir {out / 'runs'}")
    return results


def _run_jobs(runner: Runner, jobs: list[Job], t0: float) -> None:
    t = time.time()
    for k, j in enumerate(jobs, 1):
        elapsed = time.time() - t
        eta = f", about {fmt_seconds(elapsed / (k - 1) * (len(jobs) - k + 1))} left" if k > 1 else ""
        _say(f"\n[{k}/{len(jobs)}] {j.name}: {j.stage}   (t = {fmt_seconds(time.time() - t0)}{eta})")
        r = runner.run(j.stage, ["--config", str(REPO_ROOT / j.config), *j.overrides], j.run_dir,
                       j.name.replace("/", "_"), result_file=j.result)
        _say(f"  {_one_line(j, r.result)}" + ("  (reused)" if r.reused else f"  ({fmt_seconds(r.seconds)})"))


def _n_params(path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            n += int(math.prod(f.get_slice(k).get_shape()))
    return n


def _data_summary(summary: dict) -> dict:
    sp = summary.get("split") or {}
    comp = ((summary.get("tokenizer") or {}).get("compression") or {}).get("tokenizers", {})
    return {"train_records": sp.get("train_records"), "eval_records": sp.get("eval_records"),
            "bytes_per_token": {k: v.get("bytes_per_token") for k, v in comp.items()}}


def _one_line(j: Job, r: dict) -> str:
    if j.stage == "translate":
        if r.get("final_loss") is None:  # train.steps=0: the start itself
            return f"not trained (train.steps=0), P -> {r.get('p_file')}"
        return f"final loss {r['final_loss']:.4f}, P -> {r.get('p_file')}"
    m = r.get("metrics") if j.stage == "evaluate" else r.get("eval")
    if not m:
        return "done"
    return f"perplexity {m['perplexity']:.2f}, BpB {m['bpb']:.4f} (random guess BpB {m['random_guess_bpb']:.4f})"


# ----------------------------------------------------------------------------------------------------------------
# entry point


def parse(argv):
    ap = argparse.ArgumentParser(prog="s2t2 reproduce", description=__doc__.splitlines()[0], epilog=_epilog(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=["tiny", "small", "smollm2", "paper"], default="tiny",
                    help="the preset (default tiny): see the scales below")
    ap.add_argument("--phase", choices=["select", "all", "report"], default="all",
                    help="smollm2: stop after the selection runs (seed 0, validation split), run the table too, or "
                         "run nothing and write the outputs from the finished arms")
    ap.add_argument("--record", action="append", default=[], metavar="DIR",
                    help="smollm2: a directory of finished arms' records (OUT/record of another run) to reuse")
    ap.add_argument("--out", default=None, help="output directory (default runs/reproduce_SCALE)")
    ap.add_argument("--ranks", type=int, default=1, help="ranks per stage run (1: in this process; N: torchrun)")
    ap.add_argument("--cache", default=None, help="cache of the pretrained source LMs (default OUT/source_lm)")
    ap.add_argument("--collect", default=None, metavar="RUNS",
                    help="paper scale: build the table and plots from the finished cluster runs under RUNS")
    ap.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                    help="do not echo the stage subprocesses' output (--no-progress, as every command takes it)")
    ap.add_argument("overrides", nargs="*", help="ReproduceConfig keys, e.g. seeds=[0,1] p_steps=50 alphas=[0,0.1]")
    args = ap.parse_args(argv)
    return args, with_overrides(preset(args.scale), args.overrides)


SCALES = {
    "tiny": "two byte-level English LMs pretrained here, the shipped protein sample: minutes on a CPU (CI)",
    "small": "the same at 3 seeds x 200 steps with a P step sweep: ~12 min on 2 shared CPU cores",
    "smollm2": "SmolLM2-135M-Instruct (a dequantised 4-bit GGUF) on every shipped protein set: the P selection on "
               "seed 0 (~4-5 h on 2 cores), each finetuned row at 3 steps on seed 0 (~8 h: a 600-step finetune ~36 "
               "min a lane, two lanes), then ~3 h a seed, on a CPU with bf16 in hardware (one that emulates it: "
               "~15x that; lm.precision=auto); resumable, finished arms kept (--record)",
    "paper": "prints the SLURM submissions (OLMo-1B / OLMo-7B on UniRef50); --collect reads their results",
}


def _epilog() -> str:
    from s2t2_dist.api import config_rows

    lines = ["scales:"] + [f"  {k:<8} {v}" for k, v in SCALES.items()]
    lines += ["", "keys (dotted key=value after the options; each scale presets its own values, e.g. "
              "`s2t2 reproduce --scale smollm2 seeds=[0]`; defaults shown are the tiny preset's):"]
    for r in config_rows(ReproduceConfig, default_obj=preset("tiny")):
        if r.type == "section":
            lines.append(f"  [{r.key}] {r.doc}")
        else:
            lines.append(f"  {r.key}: {r.type} = {r.default}" + (f"  # {r.doc}" if r.doc else ""))
    return "\n".join(lines)


def with_overrides(cfg: ReproduceConfig, overrides: list[str]) -> ReproduceConfig:
    """The preset with dotted `key=value` overrides, through the config system (types and keys checked)."""
    from s2t2_dist.api import apply_overrides, config_from_dict, to_dict

    return config_from_dict(ReproduceConfig, apply_overrides(to_dict(cfg), list(overrides)))


def preflight(args, cfg: ReproduceConfig) -> Path | None:
    """Every option and path of the command, before any work: one line (ConfigError) for an option that does not
    apply to the scale, a directory that cannot be written, a missing input, or an output of another scale; then
    the output directory's lock (one reproduction per directory; RunDirError names the holder). Returns the
    output directory (None for the paper scale's printed plan)."""
    from s2t2_dist.api import stage_checks as checks

    lm = args.scale == "smollm2"
    if args.ranks < 1:
        raise ConfigError(f"--ranks: must be >= 1, got {args.ranks}")
    if lm and args.ranks != 1:
        raise ConfigError("--ranks: the smollm2 scale runs each arm on one rank (arms in parallel: lm.lanes=N)")
    if not lm and args.phase != "all":
        raise ConfigError(f"--phase: only the smollm2 scale runs in phases (--scale {args.scale} runs them all)")
    if not lm and args.record:
        raise ConfigError(f"--record: only the smollm2 scale reuses kept records (--scale {args.scale})")
    if args.collect and args.scale != "paper":
        raise ConfigError(f"--collect: only the paper scale collects cluster runs (--scale {args.scale})")
    if args.collect and not Path(args.collect).is_dir():
        raise ConfigError(f"--collect: {args.collect} is not a directory (the cluster runs' root, e.g. {PAPER_OUT})")
    for r in args.record:
        if not Path(r).is_dir():
            raise ConfigError(f"--record: {r} is not a directory (OUT/record of another run)")
    if lm and cfg.lm.model:
        checks.model_dir(cfg.lm.model, "lm.model")
    if args.scale == "paper" and not args.collect:
        return None
    out = Path(args.out or (Path(args.collect).parent / "reproduce_paper" if args.collect
                            else f"runs/reproduce_{args.scale}")).resolve()
    checks.writable_dir(str(out), "--out")
    if args.cache:
        checks.writable_dir(args.cache, "--cache")
    other = _scale_of(out)
    if other is not None and other != args.scale:
        raise ConfigError(f"--out: {out} holds a reproduction of scale {other}, not {args.scale}; give another --out")
    from s2t2_dist.api import lock

    lock(out, "reproduce", key="--out", until_exit=True)
    return out


def _scale_of(out: Path) -> str | None:
    """The scale of the reproduction an output directory holds (its reproduce_config.yaml), or None."""
    import yaml

    try:
        return (yaml.safe_load((out / "reproduce_config.yaml").read_text()) or {}).get("scale")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None


def _stopped(res: dict, out: Path) -> int:
    """One true line for a reproduction a signal stopped; exit 130 for Ctrl-C, 0 for SIGTERM / SIGUSR1 (a
    launcher requeues it: the rerun resumes)."""
    import signal

    name = signal.Signals(res["signal"]).name
    arms = res.get("stopped") or []
    what = ("the stage under way was stopped with it (a training stage at its checkpoint)" if res.get("local") else
            f"{len(arms)} arm(s) under way checkpointed ({', '.join(arms)})" if arms else "no arm was under way")
    kept = f"finished stages are kept under {out}" if res.get("local") else \
        f"finished arms are recorded in {out / 'record'}"
    print(f"s2t2 reproduce: stopped by {name}: {what}; {kept}; the same command resumes", file=sys.stderr, flush=True)
    return 130 if res["signal"] == signal.SIGINT else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from s2t2_dist.recipes.orchestrate import quiet_process_env

    quiet_process_env()

    try:
        from s2t2_dist.api import envvars

        envvars.check()  # the S2T2_* variables its stages will read, before the first of them starts
        args, cfg = parse(argv)
        out = preflight(args, cfg)
    except ConfigError as e:
        from s2t2_dist.api import report_user_error

        return report_user_error("s2t2 reproduce", e)
    if args.scale == "paper":
        runs = args.collect or PAPER_OUT
        jobs = build_plan(cfg, paper_setting(runs))
        if args.collect:
            from s2t2_dist.recipes.reproduce_report import collect, write_outputs

            results = collect(cfg, jobs, paper_setting(runs))
            for k, p in write_outputs(results, out).items():
                print(f"  {k:<12} {p}")
            if results["missing_runs"]:  # a partial collection is a report of what is done, and says so
                print(f"s2t2 reproduce: {len(results['missing_runs'])} of {len(jobs)} runs have no result under "
                      f"{runs} yet: their cells are empty (report.md lists them)", file=sys.stderr)
            return 0
        problems = validate_plan(jobs)
        print(paper_script(cfg, jobs), end="")
        if problems:
            print("# INVALID PLAN:\n" + "\n".join(f"#   {p}" for p in problems), file=sys.stderr)
            return 1
        print(f"# {len(jobs)} jobs; configs, overrides and dependencies validated.", file=sys.stderr)
        return 0
    if args.scale == "smollm2":
        from s2t2_dist.api import UserError
        from s2t2_dist.recipes.reproduce_lm import run_smollm2

        try:
            res = run_smollm2(cfg, out, cache=Path(args.cache).resolve() if args.cache else None,
                              echo=not args.quiet, phase=args.phase, records=[Path(r) for r in args.record])
        except UserError as e:  # an altered record, a source model that cannot be built: one line
            from s2t2_dist.api import report_user_error

            return report_user_error("s2t2 reproduce", e)
        if res.get("signal") is not None:
            return _stopped(res, out)
        return 1 if res.get("failed") else 0
    from s2t2_dist.api import stop

    try:
        run_local(cfg, out, ranks=args.ranks, cache=Path(args.cache).resolve() if args.cache else None,
                  echo=not args.quiet)
    except StageFailed as e:
        print(f"\ns2t2 reproduce: a stage failed:\n{e}", file=sys.stderr)
        return 1
    except (stop.Stopped, KeyboardInterrupt) as e:  # the stage under way was stopped with it (it checkpoints)
        import signal

        sig = e.signum if isinstance(e, stop.Stopped) else signal.SIGINT
        return _stopped({"signal": sig, "local": True}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
