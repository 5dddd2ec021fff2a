"""Evaluate: perplexity per token and bits-per-byte on held-out documents, for every row of the paper's comparisons.

    s2t2 evaluate --config configs/evaluate_olmo1b.yaml model.path=runs/finetune/final                        # (a)
    s2t2 evaluate ... model.path=allenai/OLMo-1B-hf init.kind=translated init.p_file=runs/t1b/P.safetensors   # (b)
    s2t2 evaluate ... model.path=allenai/OLMo-7B-hf init.kind=translated init.p_file=runs/t1b/P.safetensors   # (c)
    deepspeed --num_gpus 8 launch/evaluate.py --ds_config configs/ds_zero3.json --config ...          # sharded 7B

(a) a Hugging Face model directory as it is (`init.kind=as_is`, e.g. a finetuned export, which carries its
tokenizer), (b) a source model + a P file, translated and not finetuned, (c) transfer: a P learned on model A applied
to model B with the same source vocabulary (the P file's source-tokenizer hash must equal model B's; the error names
both). The baselines at initialisation are `init.kind=orig_tok` (source-tokenizer shards) and
`init.kind=new_tok_truncate`. "With finetuning" for (c) is `s2t2 finetune` with model.path=B and A's P file: its
result.json and final export carry the same metrics. The model is built exactly as finetuning builds its start
(stages/init_model.py), then held by the chosen engine (plain: a replica per rank; deepspeed / fsdp: sharded).

Raw files: `s2t2 evaluate model.path=DIR data.files=[a.fasta.gz,b.jsonl]` scores the model on FASTA (plain or
compressed), jsonl, parquet or text files directly. Every record is scored, or counted as left out with its reason
(malformed, empty, beyond eval.max_docs; the first ones by FILE:LINE) in one summary line and in the JSON. The files
are tokenized with the tokenizer the model speaks (its own for as_is) through the data pipeline's own steps and
cached under data.cache_dir, keyed by the files' content hashes and the tokenizer's hash (`data.raw_eval`).

BpB = sum NLL (nats) / (ln 2 * sum UTF-8 bytes) over the documents: a ratio of corpus sums, the same bytes whatever
the tokenizer; each rank scores its share of the documents and the totals are summed exactly. The JSON result also
holds the random-guess line ln(u) (u = the tokenizer's vocabulary) in nats per token and in BpB, and each document's
NLL, tokens and bytes by its index (`documents`: what paired intervals between two models resample). Results: RUN_DIR/
eval.json (or `output`), written atomically, and TensorBoard scalars `eval/<name>/...` under RUN_DIR/tb.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from s2t2_dist.errors import ConfigError
from s2t2_dist.data.records import FileFormatName
from s2t2_dist.engines.build import EngineConfig, build_model_and_engine, engine_kind
from s2t2_dist.models.hf import ModelPathConfig
from s2t2_dist.stages import checks
from s2t2_dist.stages.common import parse_args, run_main, run_stage
from s2t2_dist.stages.init_model import InitConfig, InitPlan

log = logging.getLogger("s2t2.evaluate")


@dataclass
class EvalDataConfig:
    #: eval shard directory (documents with byte counts) tokenized with the tokenizer the model speaks
    eval: str = ""
    #: that tokenizer (the new BPE for translated / new_tok_truncate); empty for as_is / orig_tok: the model's own
    tokenizer: str = ""
    #: raw files to score instead of shards (FASTA[.gz], jsonl[.gz], parquet, text), tokenized with that tokenizer
    files: list[str] = field(default_factory=list)
    #: format of data.files: auto (from the file name) or a file format of data/records.py FORMATS
    format: FileFormatName = "auto"
    #: column (jsonl, parquet) holding the text of a document
    text_column: str = "text"
    #: column holding a document's id (null: FILE:LINE; FASTA ids always come from the headers)
    id_column: str | None = None
    #: text files: one document per line, per blank-line separated paragraph, or per file
    text_mode: Literal["line", "paragraph", "file"] = "line"
    #: a malformed or empty record in data.files: skip it (counted, reported) or stop with FILE:LINE
    on_bad_record: Literal["skip", "error"] = "skip"
    #: where tokenized data.files are cached (default: $S2T2_CACHE_DIR/tokenized or ~/.cache/s2t2/tokenized)
    cache_dir: str = ""

    def validate(self) -> None:
        import glob
        import os

        if bool(self.eval) == bool(self.files):
            both = ("data.eval (eval shards written by `s2t2 prepare`) or data.files (raw FASTA / jsonl / parquet "
                    "/ text files)")
            raise ConfigError(f"eval: give {both}, not both" if self.eval else f"eval: one of {both} is required")
        for f in self.files:
            if not (os.path.exists(f) or glob.glob(f)):
                raise ConfigError(f"files: {f!r} does not exist")


@dataclass
class EvalOptions:
    #: tokens the model sees per window (documents longer than this are scored in rolling windows)
    context_len: int = 512
    #: rolling windows per forward call
    batch_size: int = 8
    #: evaluate the first max_docs documents of the split (0: all); independent of the number of ranks
    max_docs: int = 0
    #: auto: bf16 on GPU, fp32 on CPU; fp32; bf16
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    #: label of this evaluation in the JSON and the TensorBoard tags (default: the init kind)
    name: str = ""

    def validate(self) -> None:
        for k in ("context_len", "batch_size"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{k}: must be >= 1, got {getattr(self, k)}")
        if self.max_docs < 0:
            raise ConfigError(f"max_docs: must be >= 0 (0: all), got {self.max_docs}")


@dataclass
class EvaluateConfig:
    #: run directory: eval.json, TensorBoard logs (tb/), the resolved config.yaml
    run_dir: str = "runs/evaluate"
    #: the JSON result; default RUN_DIR/eval.json
    output: str = ""
    #: random seed (evaluation itself is deterministic)
    seed: int = 0
    #: the model evaluated (init.kind=as_is / orig_tok) or the source model a P file is applied to (translated)
    model: ModelPathConfig = field(default_factory=ModelPathConfig)
    #: what it is scored on: prepared eval shards or raw files
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    #: how the model is built from model.path (as_is: used as it is)
    init: InitConfig = field(default_factory=lambda: InitConfig(kind="as_is"))
    #: plain (a replica per rank) | deepspeed | fsdp (sharded, for models that do not fit one device)
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: scoring options
    eval: EvalOptions = field(default_factory=EvalOptions)

    def validate(self) -> None:
        from s2t2_dist.train.config import check_seed

        check_seed(self.seed)


def _eval_train_config(cfg: EvaluateConfig, world: int):
    """The engines are built for training; evaluation gives them a one-step layout (no optimiser step is taken,
    so Adam's moments are never allocated; ZeRO-3 does keep its float32 partition of the weights)."""
    from s2t2_dist.train.config import OptimConfig, TrainConfig

    return OptimConfig(), TrainConfig(steps=1, batch_size=world, micro_batch_size=1, context_len=cfg.eval.context_len,
                                      seed=cfg.seed, precision=cfg.eval.precision)


def build_eval_model(cfg: EvaluateConfig, plan: InitPlan, rt):
    """(model, engine) in eval mode; a replica (plain) is held in the compute dtype, sharded engines keep float32
    weights and compute in bf16 themselves."""
    optim, train = _eval_train_config(cfg, rt.env.world_size)
    model, engine = build_model_and_engine(cfg.engine, plan.model_dir, optim, train, device=rt.device,
                                           dtype=rt.dtype, trust_remote_code=cfg.model.trust_remote_code)
    engine.eval()
    return model, engine


def preflight(cfg: EvaluateConfig) -> tuple[InitPlan, dict] | None:
    """Before any weight is read: the model directory, its tokenizer against its embedding rows, its positions
    against eval.context_len, the eval shards (not empty; against data.tokenizer when it is given). Returns the
    run's `resolve_plan` when it could be made here (None: the work resolves it)."""
    checks.run_dir(cfg.run_dir, stage="evaluate")
    if cfg.data.files:  # the cache of tokenized files, default included ($S2T2_CACHE_DIR or ~/.cache/s2t2)
        from s2t2_dist.data.raw_eval import default_cache_dir

        checks.writable_dirs({"data.cache_dir": cfg.data.cache_dir or str(default_cache_dir())})
    checks.writable_dirs({"init.dir": cfg.init.dir,
                          "output": str(Path(cfg.output).parent) if cfg.output else ""})
    mdir = checks.model_dir(cfg.model.path)
    src = checks.model_tokenizer(mdir, trust_remote_code=cfg.model.trust_remote_code)
    checks.model_tokenizer_fits(mdir, src)
    checks.context_fits(mdir, cfg.eval.context_len, "eval.context_len")
    m = checks.shards(cfg.data.eval, "data.eval", "docs") if cfg.data.eval else None  # else raw data.files
    tok = checks.tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer and m is not None else None
    if tok is not None:
        checks.shards_match_tokenizer(m, "data.eval", tok)
    if cfg.init.kind == "translated":
        checks.input_file(cfg.init.p_file, "init.p_file")
    if mdir is not None and m is not None:  # the tokenizer the model will speak against the shards: no weights read
        from s2t2_dist.stages.init_model import check_shards, resolve_plan

        resolved = resolve_plan(cfg.init, cfg.model.path, cfg.data.tokenizer,
                                cfg.init.dir or str(Path(cfg.run_dir) / "init"), target=tok, source=src)
        check_shards(m, resolved[0], "data.eval")
        return resolved
    return None


def run(cfg: EvaluateConfig, *, progress: bool = True) -> dict:
    return run_stage(cfg, _evaluate, preflight=preflight, precision=cfg.eval.precision, seed=cfg.seed,
                     engine=cfg.engine, progress=progress, result=lambda rt: _output(cfg),
                     report=lambda rt, r: _report(rt, r, _output(cfg)))


def _output(cfg: EvaluateConfig) -> Path:
    return Path(cfg.output or Path(cfg.run_dir) / "eval.json")


def _evaluate(cfg: EvaluateConfig, rt, resolved: tuple[InitPlan, dict] | None) -> dict:
    from s2t2_dist.data.reader import EvalDocs
    from s2t2_dist.eval.scoring import evaluate_documents, hf_logits_fn
    from s2t2_dist.stages.init_model import check_shards, prepare_initial_model

    init_dir = cfg.init.dir or str(Path(cfg.run_dir) / "init")
    plan = prepare_initial_model(cfg.init, cfg.model.path, cfg.data.tokenizer, init_dir, is_main=rt.env.is_main,
                                 trust_remote_code=cfg.model.trust_remote_code, resolved=resolved)
    raw = _tokenize_raw_files(cfg, plan, rt.env.is_main, rt.progress) if cfg.data.files else None
    checks.raw_files_scored(raw, list(cfg.data.files))
    eval_dir = raw["eval_dir"] if raw else cfg.data.eval
    docs = EvalDocs(eval_dir, rank=rt.env.rank, world_size=rt.env.world_size)
    check_shards(docs.manifest, plan, "data.eval")
    model, engine = build_eval_model(cfg, plan, rt)
    autocast = engine_kind(cfg.engine.kind).autocast(rt.dtype)
    pad = plan.pad_id if plan.pad_id is not None else (plan.eos_id or 0)
    metrics, totals, per_doc = evaluate_documents(hf_logits_fn(engine.module, engine.device, autocast), docs,
                                         cfg.eval.context_len, vocab_size=plan.vocab_size,
                                         batch_size=cfg.eval.batch_size, pad_id=pad, max_docs=cfg.eval.max_docs)
    nonfinite_loss(totals.nll_nats, totals.tokens, cfg)
    name = cfg.eval.name or cfg.init.kind
    result = {"name": name, "model": cfg.model.path, "init": plan.to_dict(), "p_file": cfg.init.p_file or None,
              "eval_shards": cfg.data.eval, "context_len": cfg.eval.context_len, "max_docs": cfg.eval.max_docs,
              "world_size": rt.env.world_size, "engine": cfg.engine.kind, "metrics": metrics,
              "totals": totals.to_dict(), "documents": per_doc.to_dict()}
    if raw:
        from s2t2_dist.data.raw_eval import leave_out_beyond

        raw["records"] = leave_out_beyond(raw["records"], cfg.eval.max_docs)
        result.update(files=raw["files"], records=raw["records"], eval_shards=eval_dir)
    return result


def nonfinite_loss(nll: float, tokens: int, cfg: EvaluateConfig) -> None:
    """A total loss that is NaN or infinite is no score: the weights (or the P they were built with) produce non-finite
    logits. Refused naming the model, on every rank (the totals are all-reduced), before anything is written."""
    import math

    if math.isfinite(nll):
        return
    from s2t2_dist.errors import ModelLoadError

    built = f" built with init.p_file {cfg.init.p_file}" if cfg.init.kind == "translated" else ""
    raise ModelLoadError(f"model.path {cfg.model.path}{built}: the total loss over {tokens:,} tokens is {nll} (the "
                         "model computes non-finite logits: damaged weights, or a run that diverged); no score was "
                         "written")


def _report(rt, result: dict, out: Path) -> None:
    name, metrics = result["name"], result["metrics"]
    if "records" in result:
        from s2t2_dist.data.raw_eval import format_records

        print(f"evaluate {name}: {format_records(result['records'])}", flush=True)
    print(f"evaluate {name}: perplexity {metrics['perplexity']:.4f}, bpb {metrics['bpb']:.4f} over "
          f"{int(metrics['docs']):,} docs, {int(metrics['tokens']):,} tokens -> {out}", flush=True)
    rt.logger.scalars(0, {f"eval/{name}/{k}": v for k, v in metrics.items()})
    log.info("evaluate %s: perplexity %.4f, bpb %.4f (random guess %.4f) over %d docs", name,
             metrics["perplexity"], metrics["bpb"], metrics["random_guess_bpb"], int(metrics["docs"]))


def _tokenize_raw_files(cfg: EvaluateConfig, plan: InitPlan, is_main: bool, progress: bool = True) -> dict:
    """data.files as cached eval shards in the model's tokenizer: rank 0 tokenizes, the others then find the cache
    (a barrier between). Rank 0's error (e.g. a bad record with on_bad_record=error) stays the user error it is;
    the other ranks raise one naming rank 0."""
    from s2t2_dist.errors import DataError
    from s2t2_dist.data.raw_eval import tokenize_files
    from s2t2_dist.distributed import collectives as coll

    d = cfg.data

    def go(progress: bool) -> dict:
        return tokenize_files(list(d.files), plan.loaded["tokenizer"], cache_dir=d.cache_dir or None, format=d.format,
                              text_column=d.text_column, id_column=d.id_column, text_mode=d.text_mode,
                              on_bad_record=d.on_bad_record, progress=progress)

    if not coll.distributed():
        return go(progress)
    err, out = None, None
    if is_main:
        try:
            out = go(progress)
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            err = e
    failed = coll.any_rank(err is not None)  # also the barrier: the cache is complete when rank 0 gets here
    if err is not None:
        raise err
    if failed:
        import time

        time.sleep(1.0)  # a launcher stops every rank when the first exits: let rank 0 print the error that matters
        raise DataError("data.files: tokenizing the files failed on rank 0 (its error names the file)")
    return out if is_main else go(False)


def parse_config(argv: list[str]) -> EvaluateConfig:
    """The run config from the command line, launcher arguments included (`s2t2 submit` checks it with this)."""
    return parse_args(EvaluateConfig, argv, "s2t2 evaluate")[0]


def main(argv: list[str]) -> int:
    def work() -> dict:
        cfg, args = parse_args(EvaluateConfig, argv, "s2t2 evaluate")
        return run(cfg, progress=not args.no_progress)
    return run_main("s2t2 evaluate", work)
