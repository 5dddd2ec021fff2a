"""Real-model benchmark of the translators: a pretrained English LM on English text of its own
kind and on proteins.

    python -m bench.bench_real_model            # every row: hours on a busy 2-core CPU; results in OUT/table.md
    python -m bench.bench_real_model --out /tmp/rm --steps 300 --ft-steps 100 --only s2t2_fvt
    python -m bench.bench_real_model --source smollm2 --text c4.json.gz --regimes "v>d,protein" --batch 4 ...

`--source smollm2`: SmolLM2-135M-Instruct (`s2t2 source-lm smollm2`: d = 576, a 49,152-token byte-level BPE)
instead of stories260K; `--text FILES` (jsonl with a `text` field, e.g. web text such as C4 for SmolLM2) is the
English corpus instead of samples drawn from the model (which a 135M model on a CPU makes too slowly).

The source LM is the shipped stories260K (llama2.c, trained on TinyStories; d = 64, its own sentencepiece
vocabulary of 512). The English text is sampled from stories260K itself (temperature 1, seed 0): TinyStories-like
stories, the model's own domain, shipped nowhere else. `s2t2 prepare` splits it, trains a NEW 512-token byte-level
BPE on it and writes shards with both tokenizers. Every row is a real stage run (`translate`, `finetune`,
`evaluate`, in this process) from configs written to OUT/configs:

  original tokenizer   the source model and its own tokenizer (the ceiling), `evaluate init.kind=orig_tok`
  S2T2 / softmax / unconstrained   `translate` with translator.kind sparse / softmax / unconstrained
  FVT                  the surface-string start of `translator.init=fvt` with weight 1, not trained (its P file,
                       `evaluate init.kind=translated`)
  truncation           the new tokenizer with E, L cut to its first u rows (`init.kind=new_tok_truncate`)
  random guess         log2(u) per token, in bits per byte
each P only (frozen LM) and after `--ft-steps` of finetuning the whole model (`finetune`). Two regimes:
  v > d   source_vocab all: v = 512 source tokens against d = 64 (an unconstrained W spans the embedding space)
  v < d   the paper's regime (bytes against d = 2,048): the 48 single-character source tokens of lowest id
          (space, lower-case letters, common punctuation and capitals), v = 48 < d = 64.
"shared -> self": of the target tokens whose string is also one source token, the fraction whose largest weight
(W = P / nu) is that source token. Reruns reuse finished runs (same arguments), so subsets of rows can run in
parallel (`--only ROWS --tag T`, same --out) and a final plain invocation collects them.
  protein the demo's stage 1: the source LM on the shipped protein sample (context 128), against its unigram line
          and the source model with its own tokenizer (original tokenizer).
P's non-zeros are also given over the target columns some source piece builds ("built": translator/stats.py, column_split).
`--score-start` also scores each translate row's start untrained (`train.steps=0`, runs NAME_start): column "start".
The FVT-start rows leave translator.init_weight to the shipped default and record the value each run resolved;
`--row NAME=s2t2_fvt:init_weight=0.9` tries another (the start at v = 49,152: bench/start_anatomy.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

#: translator rows: name -> (kind, init, init_weight, recipe, lr). init_weight None: the shipped default (one home:
#: the translator config; the row records the value the run resolved). `recipe`: "default" (the
#: stage's null keys: the kind's defaults) or "paper" (configs/translate_paper.yaml's keys:
#: alpha 0, floor 0; the paper's literal uniform start uses its transfer-run lr 2e-5, which learns at v = 512). lr:
#: absolute, 0: null (the kind's automatic step). (The row "s2t2_warmup", a uniform start with the
#: dense warm-up, went with the warm-up: bench/bench_planted.py keeps it.)
TRANSLATORS = {
    "s2t2_uniform": ("sparse", "uniform", 0.0, "paper", 2e-5),
    "s2t2_fvt": ("sparse", "fvt", None, "default", 0.0),
    "softmax": ("softmax", "uniform", 0.0, "default", 0.0),
    "softmax_fvt": ("softmax", "fvt", None, "default", 0.0),
    "unconstrained": ("unconstrained", "uniform", 0.0, "default", 0.0),
    "unconstrained_fvt": ("unconstrained", "fvt", None, "default", 0.0),
}
LABELS = {
    "orig_tok": "original tokenizer (ceiling)", "s2t2_uniform": "S2T2, uniform start (paper)",
    "s2t2_fvt": "S2T2, FVT start (shipped defaults)",
    "softmax": "softmax Sinkhorn, uniform start",
    "softmax_fvt": "softmax Sinkhorn, FVT start", "unconstrained": "unconstrained, uniform start",
    "unconstrained_fvt": "unconstrained, FVT start", "fvt": "FVT (no training)", "truncate": "truncation",
    "random": "random guess", "unigram": "unigram (train-split token frequencies)",
}
#: the translator keys of the "paper" rows (configs/translate_paper.yaml's)
PAPER_KEYS = {"paper": {"alpha": 0.0, "floor": 0.0, "source_marginal": "uniform"}}
N_CHARS = 48


def say(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# inputs


def corpus(out: Path, model: Path, n_docs: int, max_tokens: int = 256, seed: int = 0) -> Path:
    """n_docs stories sampled from the source model (cut at its next BOS/EOS), one JSON line each."""
    import torch
    from transformers import AutoModelForCausalLM

    from s2t2_dist.api import load_hf_tokenizer

    path = out / f"stories_{n_docs}_{max_tokens}_s{seed}.jsonl"
    if path.is_file():
        return path
    torch.set_num_threads(1)  # a 260K-parameter model: threads only contend
    tok = load_hf_tokenizer(model)
    lm = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    torch.manual_seed(seed)
    stop = {tok.bos_token_id, tok.eos_token_id}
    lines, batch = [], 64
    while len(lines) < n_docs:
        ids = torch.full((batch, 1), tok.bos_token_id)
        with torch.no_grad():
            gen = lm.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_tokens,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        for row in gen[:, 1:].tolist():
            cut = next((k for k, t in enumerate(row) if t in stop), len(row))
            text = tok.decode(row[:cut], skip_special_tokens=True).strip()
            if len(text) > 50:
                lines.append(json.dumps({"id": f"s{len(lines)}", "text": text}))
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text("\n".join(lines[:n_docs]) + "\n")
    tmp.rename(path)
    return path


def prepare_data(out: Path, text: Path | list[str], model: Path, context_len: int, id_column: str | None = "id",
                 eval_fraction: float = 0.1) -> dict:
    from s2t2_dist.api import DataConfig
    from s2t2_dist.api import prepare

    inputs = [str(t) for t in text] if isinstance(text, list) else [str(text)]
    cfg = DataConfig(inputs=inputs, format="jsonl", text_column="text", id_column=id_column, domain="text",
                     eval_fraction=eval_fraction, seed=0, vocab_size=512, source_tokenizer=str(model),
                     context_len=context_len, shard_size=256, num_workers=0, output_dir=str(out))
    return prepare(cfg, progress=False)


def char_vocab_file(out: Path, model: Path, n: int = N_CHARS) -> Path:
    """The n single-character source tokens of lowest id (llama2.c's sentencepiece orders them by frequency),
    byte-fallback tokens left out: the v < d source vocabulary."""
    from s2t2_dist.api import source_token_ids, token_bytes

    tb = token_bytes(str(model))
    ids = [i for i in source_token_ids(str(model), "single_char").tolist()
           if not (tb[i] is not None and len(tb[i]) == 1 and i < 259)][:n]  # 3..258 are <0xNN> byte fallbacks
    path = out / f"source_chars{n}.txt"
    path.write_text("".join(f"{i}\n" for i in ids))
    return path


# ---------------------------------------------------------------------------------------------------------------
# runs


class Bench:
    def __init__(self, args):
        from s2t2_dist.api import Runner

        self.args = args
        self.out = Path(args.out).resolve()
        self.runs, self.cfgs = self.out / "runs", self.out / "configs"
        self.runner = Runner(ranks=1, log_dir=self.out / "logs", echo=False)
        self.results: dict = {}
        self._unbuilt: dict[str, list[int]] = {}
        self.tag = f"_{args.tag}" if args.tag else ""

    def train_block(self, steps: int, regime: str = "") -> dict:
        a = self.args
        ctx = 128 if regime == "protein" else a.context_len  # the demo's blocks
        return {"steps": steps, "batch_size": a.batch, "micro_batch_size": a.batch, "context_len": ctx,
                "log_every": max(1, steps // 10), "ckpt_every": 0, "eval_every": 0, "eval_max_docs": 0, "seed": a.seed}

    def data(self, source: bool = False, regime: str = "") -> dict:
        d = self.out / ("protein_data" if regime == "protein" else "data")
        split = "source" if source else "new"
        return {"train": str(d / f"shards/{split}/train"), "eval": str(d / f"shards/{split}/eval"),
                "tokenizer": str(self.model if source else d / "tokenizer"), "num_workers": 0}

    def translate(self, name: str, regime: str, kind: str, init: str, weight: float, recipe: str, lr: float,
                  extra: dict | None = None) -> dict:
        from s2t2_dist.api import write_config
        from s2t2_dist.api import TranslateConfig

        def run(tag: str, steps: int):
            run_dir = self.runs / regime / f"{name}{tag}"
            cfg = write_config(self.cfgs / regime / f"{name}{tag}.yaml", {
                "run_dir": str(run_dir), "model": {"path": str(self.model), "source_vocab": self.vocab[regime]},
                "data": self.data(regime=regime), "translator": {
                    "kind": kind, "n_iter": 3, "init": init, **({"init_weight": weight} if weight is not None else {}),
                    **PAPER_KEYS.get(recipe, {}), **(extra or {})},
                "optim": {"lr": lr or None, "weight_decay": 0.0}, "train": self.train_block(steps, regime)},
                TranslateConfig)
            return run_dir, self.runner.run("translate", ["--config", str(cfg)], run_dir, f"{regime}-{name}{tag}")

        # the start itself, scored untrained (train.steps=0): what training has to improve on
        start = run("_start", 0)[1].result["eval"]["bpb"] if self.args.score_start else None
        t0 = time.time()
        run_dir, r = run("", self.args.steps)
        self.random_bpb = r.result["eval"].get("random_guess_bpb")
        return {"p_file": r.result["p_file"], "bpb": r.result["eval"]["bpb"], "seconds": round(time.time() - t0, 1),
                "sparsity": {**sparsity(r.result["p_file"], self.unbuilt(regime)), "step_s": step_time(run_dir)},
                "final_loss": r.result.get("final_loss"), "lr": (r.result.get("gradient_on_C") or {}).get("lr", lr),
                "start": start, "init_weight": resolved_init_weight(run_dir)}

    def evaluate(self, name: str, regime: str, init: dict, source: bool = False) -> float:
        from s2t2_dist.api import write_config
        from s2t2_dist.api import EvaluateConfig

        run_dir = self.runs / regime / f"eval_{name}"
        d = self.data(source, regime)
        cfg = write_config(self.cfgs / regime / f"eval_{name}.yaml", {
            "run_dir": str(run_dir), "model": {"path": str(self.model)},
            "data": {"eval": d["eval"], "tokenizer": "" if source else d["tokenizer"]},
            "init": {**init, "dir": str(run_dir / "init")} if init["kind"] != "orig_tok" else init,
            "engine": {"kind": "plain"},
            "eval": {"context_len": 128 if regime == "protein" else self.args.context_len, "batch_size": 16, "max_docs": 0, "name": name}},
            EvaluateConfig)
        r = self.runner.run("evaluate", ["--config", str(cfg)], run_dir, f"{regime}-eval_{name}")
        self.random_bpb = r.result["metrics"].get("random_guess_bpb") if not source else getattr(self, "random_bpb", None)
        return r.result["metrics"]["bpb"]

    def finetune(self, name: str, regime: str, init: dict, source: bool = False) -> float:
        from s2t2_dist.api import write_config
        from s2t2_dist.api import FinetuneConfig

        run_dir = self.runs / regime / f"ft_{name}"
        cfg = write_config(self.cfgs / regime / f"ft_{name}.yaml", {
            "run_dir": str(run_dir), "model": {"path": str(self.model)}, "data": self.data(source, regime),
            "init": {**init, "dir": str(run_dir / "init")} if init["kind"] != "orig_tok" else init,
            "engine": {"kind": "plain"}, "optim": {"lr": self.args.ft_lr, "weight_decay": 0.01},
            "train": self.train_block(self.args.ft_steps, regime), "export": {"dir": "", "dtype": "float32"}},
            FinetuneConfig)
        r = self.runner.run("finetune", ["--config", str(cfg)], run_dir, f"{regime}-ft_{name}")
        return r.result["eval"]["bpb"]

    def fvt_p_file(self, regime: str) -> str:
        """The FVT plan itself (init_weight 1, no training) as a P file."""
        import torch
        from s2t2_dist.api import load_hf_tokenizer, load_tokenizer, source_token_ids, tokenizer_hash
        from s2t2_dist.api import SparseP, save_p
        from s2t2_dist.api import surface_prior

        path = self.runs / regime / "fvt" / "P.safetensors"
        if path.is_file():
            return str(path)
        src_tok = load_hf_tokenizer(self.model)
        src_ids = source_token_ids(src_tok, self.vocab[regime])
        tgt = load_tokenizer(self.data(regime=regime)["tokenizer"])
        v, u = src_ids.numel(), tgt.vocab_size
        mu, nu = torch.full((v,), 1.0 / v, dtype=torch.float64), torch.full((u,), 1.0 / u, dtype=torch.float64)
        P, dec, _ = surface_prior(str(self.model), src_tok, src_ids.tolist(), tgt, mu, nu, 1.0)
        # The FVT plan's columns carry nu but its rows do not carry a uniform mu (on the proteins they are off by
        # 1.9 in total, which load_p refuses): its source marginal is its own row sums, as the sparse start's is.
        mu = P.sum(1) / P.sum()
        self.results.setdefault(regime, {})["fvt_decomposition"] = {
            "coverage": dec.coverage, "empty": dec.empty, "identical": dec.identical}
        idx = (P != 0).nonzero().t().contiguous()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_p(path, SparseP(idx, P[idx[0], idx[1]].float(), mu.float(), nu.float(), src_ids,
                             tokenizer_hash(str(self.model)), tgt.hash, kind="sparse", normalization="convex"))
        return str(path)

    def unbuilt(self, regime: str) -> list[int]:
        """Target columns of `regime` that no source piece builds (their surface decomposition is empty)."""
        from s2t2_dist.api import load_hf_tokenizer, load_tokenizer, source_token_ids
        from s2t2_dist.api import surface_decomposition

        from s2t2_dist.api import unbuilt_columns

        if regime not in self._unbuilt:
            src_tok = load_hf_tokenizer(self.model)
            dec = surface_decomposition(src_tok, source_token_ids(src_tok, self.vocab[regime]).tolist(),
                                        load_tokenizer(self.data(regime=regime)["tokenizer"]))
            self._unbuilt[regime] = unbuilt_columns(dec.pieces)
        return self._unbuilt[regime]

    def shared_to_self(self, p_file: str, regime: str) -> tuple[int, int]:
        """(target tokens whose string is one source token, how many of them have that token as top source)."""
        from s2t2_dist.api import load_tokenizer, source_surface_bytes, token_bytes
        from s2t2_dist.api import load_p

        p = load_p(p_file)
        src = source_surface_bytes(str(self.model), p.source_ids.tolist())
        tgt = token_bytes(load_tokenizer(self.data(regime=regime)["tokenizer"]).tokenizer)
        row_of = {}
        for r, b in enumerate(src):
            if b:
                row_of.setdefault(b, r)
        top = p.dense().argmax(0).tolist()  # W = P / nu: the same argmax per column
        shared = [(j, row_of[b]) for j, b in tgt.items() if b and b in row_of]
        return len(shared), sum(top[j] == r for j, r in shared)

    # -----------------------------------------------------------------------------------------------------------
    def run(self) -> dict:  # noqa: C901 - a benchmark row's kinds and options, dispatched in one place
        from s2t2_dist.api import quiet_process_env, stories260k

        a = self.args
        quiet_process_env()
        self.out.mkdir(parents=True, exist_ok=True)
        if a.source == "smollm2":
            from s2t2_dist.api import smollm2

            self.model = smollm2()  # the project's cache: converted once per machine
        else:
            self.model = stories260k(self.out / "source_lm")
        text = list(a.text) if a.text else corpus(self.out / "corpus", self.model, a.docs)
        summary = prepare_data(self.out / "data", text, self.model, a.context_len,
                               id_column=a.text_id if a.text else "id", eval_fraction=a.eval_fraction)
        self.vocab = {"v>d": "all", "v<d": str(char_vocab_file(self.out, self.model)) if "v<d" in a.regimes else "",
                      "protein": "all"}
        say(f"source {self.model}; corpus {text}; data {self.out / 'data'}")
        res = self.results
        res["setup"] = {"source": a.source, "steps": a.steps, "ft_steps": a.ft_steps, "batch": [a.batch, a.context_len],
                        "ft_lr": a.ft_lr, "docs": a.docs if not a.text else None, "text": [str(t) for t in text]
                        if isinstance(text, list) else str(text), "split": summary.get("split")}
        only = set(a.only.split(",")) if a.only else None
        want = lambda n: only is None or n in only  # noqa: E731 - a one-line closure
        for regime in a.regimes.split(","):
            r = res.setdefault(regime, {})
            self.random_bpb = None
            rows = r.setdefault("rows", {})

            def put(name, **kw):
                rows.setdefault(name, {}).update(kw)
                say(f"  [{regime}] {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in rows[name].items()))
                from s2t2_dist.api import atomic_write_json

                atomic_write_json(self.out / f"results{self.tag}.json", res)

            if regime == "protein":
                from s2t2_dist.api import prepare_protein

                prepare_protein(self.out / "protein_data", vocab_size=512, context_len=128, progress=False,
                                source_tokenizer=str(self.model))
            if want("orig_tok") and regime in ("v>d", "protein"):
                put("orig_tok", p_only=self.evaluate("orig_tok", regime, {"kind": "orig_tok"}, source=True))
                if a.ft_steps:
                    put("orig_tok", finetuned=self.finetune("orig_tok", regime, {"kind": "orig_tok"}, source=True))
            if want("truncate") and regime == "v>d":
                put("truncate", p_only=self.evaluate("truncate", regime, {"kind": "new_tok_truncate"}))
                if a.ft_steps:
                    put("truncate", finetuned=self.finetune("truncate", regime, {"kind": "new_tok_truncate"}))
            if want("fvt"):
                pf = self.fvt_p_file(regime)
                n, s = self.shared_to_self(pf, regime)
                put("fvt", p_only=self.evaluate("fvt", regime, {"kind": "translated", "p_file": pf}),
                    shared=n, self_=s, **sparsity(pf, self.unbuilt(regime)))
                if a.ft_steps:
                    put("fvt", finetuned=self.finetune("fvt", regime, {"kind": "translated", "p_file": pf}))
            for name, (kind, init, w, recipe, lr, *extra) in self.variants().items():
                base = name.split("~")[0]
                if not want(base) and not (only and any(base.startswith(o + "@") for o in only)):
                    continue
                t = self.translate(name, regime, kind, init, w, recipe, lr, *extra)
                n, s = self.shared_to_self(t["p_file"], regime)
                put(name, p_only=t["bpb"], lr=t["lr"], init_weight=t["init_weight"], shared=n, self_=s, seconds=t["seconds"],
                    **({"start": t["start"]} if t["start"] is not None else {}), **t["sparsity"],
                    **(extra[0] if extra else {}))
                if a.ft_steps and "@" not in name:
                    put(name, finetuned=self.finetune(name, regime, {"kind": "translated", "p_file": t["p_file"]}))
            if regime == "protein" and want("unigram"):
                from s2t2_dist.api import unigram_reference

                d = self.data(regime=regime)
                put("unigram", p_only=unigram_reference(d["train"], d["eval"])["bpb"])
            if getattr(self, "random_bpb", None):
                put("random", p_only=self.random_bpb, finetuned=self.random_bpb)
        (self.out / f"table{self.tag}.md").write_text(table(res))
        say("\n" + table(res))
        return res

    def variants(self) -> dict:
        """The table's translators, plus a sweep `--sweep name:lr1,lr2:w1,w2` of one of them (rows name@lr@w)."""
        v = dict(TRANSLATORS)
        for spec in self.args.sweep:
            name, lrs, ws = (spec.split(":") + ["", ""])[:3]
            kind, init, w0, recipe, lr0 = TRANSLATORS[name]
            for lr in [float(x) for x in lrs.split(",") if x] or [lr0]:
                for w in [float(x) for x in ws.split(",") if x] or [w0]:
                    v[f"{name}@{lr:g}@{'default' if w is None else format(w, 'g')}"] = (kind, init, w, recipe, lr)
        for spec in self.args.row:  # NAME=BASE:key=value,key=value (translator keys; numbers parsed)
            name, rest = spec.split("=", 1)
            base, _, kv = rest.partition(":")
            kind, init, w, recipe, lr, *extra = TRANSLATORS[base]
            keys = dict(extra[0]) if extra else {}
            for item in filter(None, kv.split(",")):
                k, val = item.split("=", 1)
                keys[k] = _number(val)
            w = keys.pop("init_weight", w)
            v[name] = (kind, init, None if w is None else float(w), recipe, float(keys.pop("lr", lr)), keys)
        if self.args.seed:  # other seeds: their own runs
            v = {f"{k}~s{self.args.seed}": x for k, x in v.items()}
        return v


def _number(s: str):
    try:
        return int(s)
    except ValueError:
        try:
            return float(s)
        except ValueError:
            return s


def sparsity(p_file: str, unbuilt: list[int] | None = None) -> dict:
    """Non-zeros per target column, density and mass-based sparsity (W = P / nu) of a P file; with `unbuilt`
    (target columns no source piece builds) also the density over the other columns."""
    from s2t2_dist.api import load_p
    from s2t2_dist.api import column_split

    p = load_p(p_file)
    st = p.stats()
    out = {k: st[k] for k in ("density", "col_nnz_mean", "max_weight_mean", "col_entropy_mean")}
    if unbuilt is not None:
        nz = p.values != 0
        cols = p.indices[1][nz].bincount(minlength=p.shape[1])
        out.update(column_split(cols, p.shape[0], unbuilt))
    return out


def resolved_init_weight(run_dir: Path) -> float | None:
    """translator.init_weight as the run resolved it (its config.yaml), None where the run has none."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    w = (yaml.safe_load(path.read_text()).get("translator") or {}).get("init_weight") if path.is_file() else None
    return None if w is None else float(w)


def step_time(run_dir: Path) -> float | None:
    """Median seconds per training step of a run (TensorBoard `node/step_time_s`, one value per log interval)."""
    import statistics

    from s2t2_dist.api import tb_scalars

    tb = Path(run_dir) / "tb" / "node_000"
    vals = [v for _, v in tb_scalars(tb, "node/step_time_s")] if tb.is_dir() else []
    return round(statistics.median(vals), 3) if vals else None


def table(res: dict) -> str:
    s = res["setup"]
    lines = [f"{s.get('source', 'stories260k')}, new 512-token byte-level BPE, {s['steps']} P steps / {s['ft_steps']} finetuning steps "
             f"(lr {s['ft_lr']:g}), batch {s['batch'][0]} x {s['batch'][1]}; held-out bits per byte (lower is "
             "better)", ""]
    for regime in ("v>d", "v<d", "protein"):
        r = res.get(regime)
        if not r:
            continue
        dec = r.get("fvt_decomposition") or {}
        lines += [f"### {regime}" + (f" (FVT covers {100 * dec['coverage']:.1f}% of target bytes; "
                                      f"{dec['identical']} target tokens are one source token)" if dec else ""), "",
                  "| method | P lr | init weight | start | P only | + finetune | shared -> self | non-zeros | per column | "
                  "non-zeros, built columns | per built column | max weight | col. entropy | s/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, row in r["rows"].items():
            label = LABELS.get(name.split("@")[0].split("~")[0], name) + (f" ({name.split('@', 1)[1]})" if "@" in name else "")
            f = lambda x, fmt=".3f": "" if x is None else format(x, fmt)  # noqa: E731 - a one-line closure
            sh = f"{row['self_']}/{row['shared']}" if "shared" in row else ""
            lines.append(f"| {label} | {f(row.get('lr'), 'g')} | {f(row.get('init_weight'), 'g')} | "
                         f"{f(row.get('start'))} | {f(row.get('p_only'))} | {f(row.get('finetuned'))} | {sh} | {f(row.get('density'), '.1%')} | "
                         f"{f(row.get('col_nnz_mean'), '.1f')} | {f(row.get('density_built'), '.2%')} | "
                         f"{f(row.get('col_nnz_mean_built'), '.2f')} | {f(row.get('max_weight_mean'))} | "
                         f"{f(row.get('col_entropy_mean'), '.2f')} | {f(row.get('step_s'), '.2f')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_real_model")
    ap.add_argument("--steps", type=int, default=300, help="stage-1 (P) steps")
    ap.add_argument("--ft-steps", type=int, default=100, help="finetuning steps (0: P only)")
    ap.add_argument("--ft-lr", type=float, default=1e-3)
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="train.batch_size of every run (one micro-batch)")
    ap.add_argument("--source", default="stories260k", choices=["stories260k", "smollm2"], help="the source LM")
    ap.add_argument("--text", nargs="+", default=None,
                    help="English corpus: jsonl files with a `text` field (default: stories sampled from the source)")
    ap.add_argument("--text-id", default="url", help="with --text: the record id field (the split hashes it)")
    ap.add_argument("--eval-fraction", type=float, default=0.1, help="held-out share of the English documents")
    ap.add_argument("--docs", type=int, default=640, help="stories sampled from the source (without --text)")
    ap.add_argument("--regimes", default="v>d,v<d,protein")
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--sweep", action="append", default=[],
                    help="extra rows NAME:LR1,LR2:W1,W2 (LRs absolute, 0: the kind's default; "
                         "e.g. s2t2_fvt:2e-5,1e-4:0.1,0.5), P only")
    ap.add_argument("--row", action="append", default=[],
                    help="extra rows NAME=BASE:KEY=VALUE,... (translator keys of row BASE changed; init_weight and "
                         "lr too), e.g. s2t2_a1=s2t2_fvt:alpha=1")
    ap.add_argument("--score-start", action="store_true",
                    help="also score each translate row's start untrained (train.steps=0; column 'start')")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of the translate rows (rows named NAME~sSEED)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: a 260K-parameter model gains nothing from more on a busy CPU)")
    ap.add_argument("--tag", default="", help="name results_TAG.json / table_TAG.md (parallel invocations)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
