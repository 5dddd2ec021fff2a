"""`s2t2 demo`: the whole S2T2 pipeline on the protein sample shipped with the package, in minutes on a CPU.

    s2t2 demo                      # or: python launch/demo.py
    s2t2 demo --out /tmp/demo --ranks 1 --steps 30 --source english-bytes

No network. Phases (each reuses its finished outputs when the demo is run again with the same settings):
  1. prepare   the shipped protein FASTA (real UniProtKB/UniRef50 sequences) -> split, a residue-level BPE
               tokenizer, train/eval shards;
  2. source LM a small real English LM: stories260K (shipped llama2.c checkpoint, converted to Hugging Face) or a
               byte-level English LM pretrained here on the shipped Shakespeare text (`models.pretrain_english`);
  3. translate stage 1: learn the sparse translation P through the frozen LM, on `--ranks` ranks (torchrun, gloo
               on a CPU): C is sharded by columns across the ranks;
  4. finetune  stage 2: continue training the whole translated model ("S2T2 + CFT"), export a Hugging Face model;
  5. evaluate  perplexity and bits-per-byte of the exported model on the held-out proteins, against the
               random-guess line ln(u) and a unigram model of the train split;
  6. report    results.json, report.md, TensorBoard logs (`tensorboard --logdir OUT/runs`).
The stage runs are the same commands a user would type; their configs are written to OUT/configs/ and their
command lines to the report.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from s2t2_dist.recipes.orchestrate import Runner, StageFailed, fmt_seconds, quiet_process_env

SOURCES = ("stories260k", "english-bytes")

#: the byte-level English LM the demo pretrains for --source english-bytes (about a minute on 2 CPU cores)
DEMO_ENGLISH_RECIPE = dict(n_layers=2, d_model=64, n_heads=4, context_len=128, batch_size=16, steps=300, lr=3e-3,
                           warmup=20, seed=0)


def _say(msg: str = "") -> None:
    print(msg, flush=True)


class Phases:
    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.time()
        self.times: dict[str, float] = {}
        self._cur: tuple[str, float] | None = None

    def start(self, key: str, title: str) -> None:
        self.end()
        self.n += 1
        self._cur = (key, time.time())
        _say(f"\n[{self.n}/{self.total}] {title}   (t = {fmt_seconds(time.time() - self.t0)})")

    def end(self) -> None:
        if self._cur is not None:
            key, t = self._cur
            self.times[key] = round(time.time() - t, 1)
            self._cur = None


def write_config(path: Path, cfg: dict, cls) -> Path:
    """Write a stage config as YAML and check it through the config system before any process starts."""
    import yaml

    from s2t2_dist.api import load_config

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    load_config(cls, path)
    return path


def p_summary(p_file: str | Path, target_tokenizer: str | Path, source_model: str | Path, show: str = "ACDEGKLS"
              ) -> dict:
    """Sparsity of a P file and the top source tokens of a few single-residue target tokens."""
    from s2t2_dist.api import load_model_tokenizer, load_tokenizer, token_bytes
    from s2t2_dist.api import load_p

    p = load_p(p_file)
    v = p.shape[0]
    tgt = load_tokenizer(target_tokenizer).tokenizer
    src_tok = load_model_tokenizer(source_model).tokenizer
    src = token_bytes(src_tok)

    def name(i: int) -> str:
        b = src.get(i)
        if b is None:  # a special token
            return src_tok.id_to_token(i) or f"<{i}>"
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:  # a lone byte of a multi-byte character
            return "<0x" + b.hex().upper() + ">"
    from s2t2_dist.api import translation_weights

    W = translation_weights(p.dense(), p.mu, p.nu, p.normalization, "head")  # the head weights of each target column
    top = {}
    for ch in show:
        j = tgt.token_to_id(ch)
        if j is None:
            continue
        w, i = W[:, j].topk(min(3, v))
        top[ch] = [(name(int(p.source_ids[k])), round(float(x), 3)) for x, k in zip(w.tolist(), i.tolist()) if x > 0]
    return {**p.stats(), "top": top}


def parse(argv):
    ap = argparse.ArgumentParser(prog="s2t2 demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    ap.add_argument("--ranks", type=int, default=2,
                    help="ranks of the translate/finetune stages (default 2: torchrun, gloo; 1: in this process)")
    # 300: enough for the finetuned model to beat the unigram line (60 steps only reach it); BENCHMARKS.md, "Demo
    # and reproduce", has its wall time
    ap.add_argument("--steps", type=int, default=300, help="optimiser steps of stage 1 and of stage 2 (each)")
    ap.add_argument("--source", choices=SOURCES, default="stories260k",
                    help="source LM: the shipped stories260K (default) or a byte-level English LM pretrained here")
    ap.add_argument("--context-len", type=int, default=128, help="tokens per training block (default 128)")
    ap.add_argument("--vocab-size", type=int, default=512, help="target BPE vocabulary (paper: 512)")
    ap.add_argument("--p-lr", type=float, default=None,
                    help="stage-1 learning rate, absolute (default: 0.01/v = 2e-5 for stories260k, the best step "
                         "measured on these proteins (the stage's automatic step is 0.015/u); 1e-3 for english-bytes)")
    ap.add_argument("--ft-lr", type=float, default=1e-3, help="stage-2 learning rate (default 1e-3)")
    ap.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                    help="do not echo the stage processes' output (--no-progress, as every command takes it)")
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.steps < 1:
        ap.error("--ranks and --steps must be >= 1")
    return args


def run(args) -> dict:
    from s2t2_dist.api import FinetuneConfig
    from s2t2_dist.api import EvaluateConfig
    from s2t2_dist.recipes.orchestrate import english_bytes, prepare_protein, stories260k, unigram_reference
    from s2t2_dist.api import TranslateConfig
    from s2t2_dist.api import atomic_write_json, atomic_write_text

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs, cfgs = out / "runs", out / "configs"
    ph = Phases(6)
    _say(f"S2T2 demo -> {out}\n  source LM {args.source}, {args.ranks} rank(s), {args.steps} steps per stage")
    batch = 8 if 8 % args.ranks == 0 else args.ranks * 4
    micro = batch // args.ranks
    results: dict = {"out": str(out), "source": args.source, "ranks": args.ranks, "steps": args.steps,
                     "context_len": args.context_len, "batch_size": batch}

    # 1 ---------------------------------------------------------------------------------------------------------
    ph.start("prepare", "prepare: shipped protein sample -> split, BPE tokenizer, shards")
    data = out / "data"
    # split by text: the sample holds a few identical sequences under different ids, which a split by id can put on
    # both sides (an eval text also trained on); by text they stay in one split
    summary = prepare_protein(data, vocab_size=args.vocab_size, context_len=args.context_len, progress=True,
                              split_by="text")
    sp = summary.get("split", {})
    comp = ((summary.get("tokenizer") or {}).get("compression") or {}).get("tokenizers", {}).get("new", {})
    _say(f"  {sp.get('train_records')} train / {sp.get('eval_records')} eval sequences; BPE vocabulary "
         f"{args.vocab_size}: {comp.get('bytes_per_token', float('nan')):.2f} residues per token")
    results["data"] = {"dir": str(data), "train_records": sp.get("train_records"),
                       "eval_records": sp.get("eval_records"), "bytes_per_token": comp.get("bytes_per_token")}

    # 2 ---------------------------------------------------------------------------------------------------------
    cache = out / "source_lm"
    if args.source == "stories260k":
        ph.start("source", "source LM: stories260K (real, pretrained on TinyStories) -> Hugging Face format")
        model = stories260k(cache)
        # the shipped defaults (FVT start, alpha 0.3, floor 1) at lr 0.01/v = 2e-5 for stories260K's v = 512 source
        # tokens: on these proteins the best measured stage 1 (docs/translator.md, "Step size"; on the split by id)
        recipe, p_lr = ("paper", args.p_lr) if args.p_lr else ("default", 0.01 / 512)
        results["source_lm"] = {"path": str(model), "kind": "stories260K: llama2.c's 260K-parameter Llama, vocabulary 512"}
    else:
        ph.start("source", "source LM: pretrain a byte-level English LM on the shipped Shakespeare text")
        model, info = english_bytes(cache, log=lambda m: _say("  " + m), **DEMO_ENGLISH_RECIPE)
        recipe, p_lr = "paper", args.p_lr or 1e-3
        results["source_lm"] = {"path": str(model), "kind": "english-bytes: a byte-level English LM pretrained by models.pretrain_english",
                                "val_loss": info.get("val_loss_after"), "recipe": DEMO_ENGLISH_RECIPE}
    _say(f"  {model}")

    common_data = {"train": str(data / "shards/new/train"), "eval": str(data / "shards/new/eval"),
                   "tokenizer": str(data / "tokenizer"), "num_workers": 0}
    train = {"steps": args.steps, "batch_size": batch, "micro_batch_size": micro, "context_len": args.context_len,
             "log_every": max(1, args.steps // 12), "ckpt_every": 0, "eval_every": 0, "eval_max_docs": 0, "seed": 0}
    runner = Runner(ranks=args.ranks, log_dir=out / "logs", echo=not args.quiet, root=out)

    # 3 ---------------------------------------------------------------------------------------------------------
    where = f"{args.ranks} ranks (torchrun, C sharded by columns)" if args.ranks > 1 else "1 rank (in process)"
    ph.start("translate", f"translate (stage 1): learn P through the frozen LM on {where}")
    tcfg = write_config(cfgs / "translate.yaml", {
        "run_dir": str(runs / "translate"), "model": {"path": str(model), "source_vocab": "all"},
        "data": common_data, "translator": {"kind": "sparse", "n_iter": 3, "heatmap": [64, 64],
                                      # paper: no entropy term, no weight floor (configs/translate_paper.yaml's)
                                      **({"alpha": 0.0, "floor": 0.0} if recipe == "paper" else {})},
        "optim": {"lr": p_lr, "weight_decay": 0.0}, "train": train}, TranslateConfig)
    tr = runner.run("translate", ["--config", str(tcfg)], runs / "translate", "translate")
    p_file = tr.result["p_file"]
    ps = p_summary(p_file, data / "tokenizer", model)
    ev = tr.result.get("eval") or {}
    # one fact per line: a newcomer reads these in a terminal
    _say(f"  loss = ce + alpha*H(P) {_first_last(runs / 'translate')}; of which ce "
         f"{_first_last(runs / 'translate', 'train/ce')}")
    _say(f"  P: {ps['nnz']:,} of {ps['v']}x{ps['u']} entries non-zero (density {ps['density']:.3f}), "
         f"{ps['col_nnz_mean']:.1f} source tokens per target token")
    _say(f"  P by mass: mean largest weight per column of W = P/nu {ps['max_weight_mean']:.3f} (1 = one source token "
         f"each), column entropy {ps['col_entropy_mean']:.2f} nats (uniform {math.log(ps['v']):.2f})")
    _say("  learned translations, top source tokens (weight in W = P/nu) of some residues: " + "; ".join(
        f"{k} <- " + ", ".join(f"{s!r} {w:.2f}" for s, w in v) for k, v in list(ps["top"].items())[:4]))
    results["translate"] = {"run_dir": str(runs / "translate"), "p_file": p_file, "P": ps, "eval": ev,
                            "final_loss": tr.result.get("final_loss"), "command": tr.command}

    # 4 ---------------------------------------------------------------------------------------------------------
    where_ft = f"{args.ranks} ranks (torchrun, data parallel)" if args.ranks > 1 else "1 rank (in process)"
    ph.start("finetune", f"finetune (stage 2): continue training the translated model on {where_ft}")
    fcfg = write_config(cfgs / "finetune.yaml", {
        "run_dir": str(runs / "finetune"), "model": {"path": str(model)}, "data": common_data,
        "init": {"kind": "translated", "p_file": p_file}, "engine": {"kind": "plain"},
        "optim": {"lr": args.ft_lr, "weight_decay": 0.01}, "train": train,
        "export": {"dir": str(out / "model"), "dtype": "float32"}}, FinetuneConfig)
    ft = runner.run("finetune", ["--config", str(fcfg)], runs / "finetune", "finetune")
    export = ft.result["export"]
    _say(f"  loss {_first_last(runs / 'finetune')}; exported {export}")
    results["finetune"] = {"run_dir": str(runs / "finetune"), "export": export, "eval": ft.result.get("eval"),
                           "final_loss": ft.result.get("final_loss"), "command": ft.command}

    # 5 ---------------------------------------------------------------------------------------------------------
    ph.start("evaluate", "evaluate: the exported Hugging Face model on the held-out proteins")
    ecfg = write_config(cfgs / "evaluate.yaml", {
        "run_dir": str(runs / "evaluate"), "model": {"path": export}, "data": {"eval": common_data["eval"]},
        "init": {"kind": "as_is"}, "engine": {"kind": "plain"},
        "eval": {"context_len": args.context_len, "batch_size": 16, "max_docs": 0, "name": "s2t2_cft"}},
        EvaluateConfig)
    evr = Runner(ranks=1, log_dir=out / "logs", echo=not args.quiet, root=out).run(
        "evaluate", ["--config", str(ecfg)], runs / "evaluate", "evaluate")
    m = evr.result["metrics"]
    results["evaluate"] = {"run_dir": str(runs / "evaluate"), "metrics": m, "command": evr.command}
    uni = unigram_reference(common_data["train"], common_data["eval"])
    results["unigram"] = uni
    rows = [("random guess (uniform over the u target tokens)", math.exp(m["random_guess_nll_per_token"]),
             m["random_guess_bpb"]),
            ("unigram (only the train split's token frequencies)", uni["perplexity"], uni["bpb"]),
            ("S2T2: learned P, frozen source LM (stage 1 only)", ev.get("perplexity"), ev.get("bpb")),
            ("S2T2 + CFT: finetuned, exported HF model", m["perplexity"], m["bpb"])]
    results["table"] = [{"model": r[0], "perplexity": r[1], "bpb": r[2]} for r in rows]
    results["below_baseline"] = below_baseline(rows, args.steps)
    _say(_table(rows))
    for note in results["below_baseline"]:
        _say(f"  * {note}")

    # 6 ---------------------------------------------------------------------------------------------------------
    ph.start("report", "report")
    ph.end()
    results["seconds"] = {**ph.times, "total": round(time.time() - ph.t0, 1)}
    results["reused_runs"] = [r.name for r in (*runner.history, evr) if r.reused]  # finished earlier, same settings
    results["tensorboard"] = f"tensorboard --logdir {runs}"
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "report.md", _report(results, rows))
    _say(f"\nDone in {fmt_seconds(results['seconds']['total'])}.")
    _say(f"  results      {out / 'results.json'}")
    _say(f"  report       {out / 'report.md'}")
    _say(f"  HF model     {export}   (AutoModelForCausalLM / AutoTokenizer .from_pretrained)")
    _say(f"  TensorBoard  tensorboard --logdir {runs}")
    _say(f"  stage logs   {out / 'logs'}   configs {cfgs}")
    return results


def _first_last(run_dir: Path, tag: str = "train/loss") -> str:
    from s2t2_dist.recipes.orchestrate import tb_scalars

    pts = tb_scalars(run_dir / "tb" / "global", tag)
    if not pts:
        return "(no curve)"
    return f"{pts[0][1]:.3f} (step {pts[0][0]}) -> {pts[-1][1]:.3f} (step {pts[-1][0]})"


def _num(x, f=".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, f)


#: the rows that need no training (the first two of the table): a trained stage that does not beat the better of
#: them has learned nothing a table of token frequencies does not know
BASELINES = 2


def below_baseline(rows, steps: int) -> list[str]:
    """One note per trained row (S2T2 stage 1, S2T2 + CFT) whose BpB is not below the best training-free baseline
    (random guess, unigram), saying so and why it can happen at demo size."""
    named = [(n, b) for n, _, b in rows[:BASELINES] if b is not None and math.isfinite(b)]
    if not named:
        return []
    base_name, base = min(named, key=lambda r: r[1])
    notes = []
    for name, _, b in rows[BASELINES:]:
        if b is not None and math.isfinite(b) and b >= base:
            notes.append(f"{name} scores worse than the {base_name.split(' (')[0]} baseline "
                         f"({b:.3f} vs {base:.3f} BpB): after {steps} steps through a tiny English LM "
                         "the translated model predicts these proteins no better than token frequencies alone; a "
                         "demo run shows the pipeline working, not the method's quality (`s2t2 reproduce` compares "
                         "with the baselines at larger scale)")
    return notes


def _table(rows) -> str:
    lines = ["", f"  {'held-out proteins':<52} {'perplexity':>10} {'BpB':>7}"]
    marks = _marks(rows)
    lines += [f"  {name:<52} {_num(pp):>10} {_num(b, '.3f'):>7}{m}" for (name, pp, b), m in zip(rows, marks)]
    return "\n".join(lines)


def _marks(rows) -> list[str]:
    """" *" on a trained row that does not beat the best training-free baseline (below_baseline says why)."""
    named = [b for _, _, b in rows[:BASELINES] if b is not None and math.isfinite(b)]
    base = min(named) if named else math.inf
    return ["" if i < BASELINES or b is None or not math.isfinite(b) or b < base else " *"
            for i, (_, _, b) in enumerate(rows)]


def _report(r: dict, rows) -> str:
    t = r["translate"]["P"]
    lines = [
        "# S2T2 demo report", "",
        f"Source LM: {r['source_lm']['kind']} (`{r['source_lm']['path']}`). Target: the shipped protein sample "
        f"({r['data']['train_records']} train / {r['data']['eval_records']} held-out sequences), BPE vocabulary "
        f"u = {t['u']} ({_num(r['data']['bytes_per_token'])} residues per token). {r['ranks']} rank(s), "
        f"{r['steps']} steps per stage, batch {r['batch_size']} x {r['context_len']} tokens.", "",
        "| held-out proteins | perplexity | bits per byte |", "|---|---:|---:|",
        *[f"| {n}{m} | {_num(pp)} | {_num(b, '.3f')} |" for (n, pp, b), m in zip(rows, _marks(rows))], "",
        *[f"\\* {note}" for note in r.get("below_baseline", [])], "",
        "Perplexity is per target token; bits per byte = total NLL / (ln 2 x UTF-8 bytes of the held-out sequences). "
        f"A demo-sized run ({r['steps']} steps per stage on a tiny source LM) shows the pipeline working, not the "
        "paper's numbers: see `s2t2 reproduce` for the comparison with the baselines.", "",
        f"P: {t['nnz']:,} non-zeros of {t['v']} x {t['u']} (density {t['density']:.3f}, "
        f"{t['col_nnz_mean']:.1f} source tokens per target token on average), entropy {t['entropy']:.2f} nats "
        f"(uniform: {t['entropy_uniform']:.2f}). By mass (W = P/nu, each column sums to one): the mean largest weight "
        f"per target column is {t['max_weight_mean']:.3f} (1.0: every target token reads one source token) and the "
        f"mean column entropy {t['col_entropy_mean']:.2f} nats (uniform: {math.log(t['v']):.2f}); non-zero counts "
        "alone call a column with 99% of its mass on one entry dense.", "",
        "Top source tokens (weight P/nu) of some single-residue target tokens:", "",
        *[f"- `{k}` <- " + ", ".join(f"`{s!r}` {w:.2f}" for s, w in v) for k, v in t["top"].items()], "",
        "## Outputs", "",
        f"- results: `{r['out']}/results.json`",
        f"- exported Hugging Face model: `{r['finetune']['export']}`",
        f"- TensorBoard: `{r['tensorboard']}` (stage 1: loss, P density/entropy/marginal errors, a heatmap of P and "
        "its top translations; stage 2: loss, learning rate, throughput)",
        f"- stage configs: `{r['out']}/configs/`, logs: `{r['out']}/logs/`", "",
        "## Commands (what the demo ran)", "",
        "```", r["translate"]["command"], r["finetune"]["command"], r["evaluate"]["command"], "```", "",
        "## Time per phase (seconds)", "",
        "| " + " | ".join(r["seconds"]) + " |", "|" + "---|" * len(r["seconds"]),
        "| " + " | ".join(str(v) for v in r["seconds"].values()) + " |", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    from s2t2_dist.api import envvars
    from s2t2_dist.api import report_user_error

    try:
        envvars.check()  # the S2T2_* variables its stages will read, before the first of them starts
    except envvars.EnvError as e:
        return report_user_error("s2t2 demo", e)
    quiet_process_env()
    try:
        run(args)
    except StageFailed as e:
        print(f"\ns2t2 demo: a stage failed:\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
