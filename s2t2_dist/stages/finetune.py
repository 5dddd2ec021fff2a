"""Stage 2, finetune: continue training the whole model on the target domain, from any of the paper's starts.

    deepspeed --num_gpus 8 launch/finetune.py --ds_config configs/ds_zero3.json --config configs/finetune_olmo7b.yaml
    torchrun --nproc_per_node 8 launch/finetune.py --config configs/finetune_olmo1b.yaml engine.kind=fsdp
    s2t2 finetune --config configs/finetune_olmo1b.yaml init.kind=orig_tok data.train=... data.tokenizer=...

The start is chosen by `init.kind` (stages/init_model.py): `translated` (E', L' from a stage-1 P file of any
translator kind: "S2T2 + CFT", "Sinkhorn P + CFT", "Plain P + CFT"), `new_tok_truncate` ("FT new tok."),
`orig_tok` ("FT orig. tok."). Rank 0 writes the initial model as a Hugging Face directory; every rank loads it
through `build_model_and_engine`, so under ZeRO-3 it is built straight into partitions. Training is the shared
loop (train/loop.py) with the engine's own sharded, resumable checkpoints; held-out perplexity and bits-per-byte
are computed every `train.eval_every` steps and at the end; the final model is exported as a standard Hugging Face
directory (RUN_DIR/final: config with the new vocabulary, safetensors, the tokenizer the model speaks) that plain
`transformers` loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from s2t2_dist.eval.scoring import ScoringConfig
from s2t2_dist.data.config import DataPaths
from s2t2_dist.engines.build import EngineConfig, build_model_and_engine, engine_kind
from s2t2_dist.models import chunked_loss
from s2t2_dist.errors import ConfigError
from s2t2_dist.models.hf import ModelPathConfig, build_causal_lm, get_embedding_and_head
from s2t2_dist.stages import checks
from s2t2_dist.stages.common import (Runtime, config_part, fingerprint, parse_args, record_config, run_main,
                                     run_stage)
from s2t2_dist.stages.init_model import InitConfig, InitPlan
import s2t2_dist.train.phases as phases
from s2t2_dist.train.config import OptimConfig, TrainConfig
from s2t2_dist.train.loop import Task

log = logging.getLogger("s2t2.finetune")

EXPORT_INFO = "s2t2_export.json"


@dataclass
class ExportConfig:
    #: the final Hugging Face directory; default RUN_DIR/final
    dir: str = ""
    #: dtype of the exported weights (training keeps float32 master weights)
    dtype: Literal["float32", "bfloat16"] = "float32"


def _paper_optim() -> OptimConfig:
    # paper: AdamW lr 2e-5, weight decay 0.01, betas (0.9, 0.95), eps 1e-5, cosine with 20% warm-up to 10%
    return OptimConfig(lr=2e-5, weight_decay=0.01, betas=[0.9, 0.95], eps=1e-5, warmup_frac=0.2, final_lr_frac=0.1,
                       grad_clip=1.0)


@dataclass
class FinetuneConfig:
    #: run directory: checkpoints, final export, result.json, TensorBoard logs (tb/)
    run_dir: str = "runs/finetune"
    #: the source model (Hugging Face directory or hub id); float32 master weights, train.precision selects bf16 compute
    model: ModelPathConfig = field(default_factory=ModelPathConfig)
    #: shards and the tokenizer the model will speak (the new BPE; the source tokenizer for init.kind=orig_tok)
    data: DataPaths = field(default_factory=DataPaths)
    #: plain | deepspeed (ZeRO, from --ds_config) | fsdp; see engines/build.py
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: AdamW and its learning-rate schedule (defaults: the paper's stage-2 settings)
    optim: OptimConfig = field(default_factory=_paper_optim)
    #: steps, batch layout, precision, logging, evaluation and checkpoint cadence
    train: TrainConfig = field(default_factory=TrainConfig)
    #: the model training starts from: translated (a P file), new_tok_truncate, orig_tok
    init: InitConfig = field(default_factory=InitConfig)
    #: held-out evaluation options
    eval: ScoringConfig = field(default_factory=ScoringConfig)
    #: the final Hugging Face export
    export: ExportConfig = field(default_factory=ExportConfig)
    #: what trains: all (the whole model) or embeddings (only E and L on the frozen body: with a translated start,
    #: the P-only ceiling probe; engine.kind=plain)
    trainable: Literal["all", "embeddings"] = "all"


# ----------------------------------------------------------------------------------------------------------------
# task


class FinetuneTask(Task):
    """Next-token loss of the whole model in the vocabulary it now speaks; held-out perplexity and BpB."""

    def __init__(self, engine, rt: Runtime, plan: InitPlan, cfg: FinetuneConfig, eval_docs=None):
        self.engine, self.rt, self.plan, self.cfg = engine, rt, plan, cfg
        self.eval_docs = eval_docs
        self.autocast = engine_kind(cfg.engine.kind).autocast(rt.dtype)
        # the loss in chunks of the head (None: transformers' loss over the full logits)
        self.head = chunked_loss.install(engine.model, cfg.engine.loss_chunk_tokens)

    def loss(self, batch):
        ids = batch["input_ids"].to(self.engine.device, non_blocking=True)
        cast = torch.autocast(ids.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()
        if self.head is not None:  # the head returns the loss in place of the logits
            with cast, windows_not_packed(), self.head.armed(ids):
                return self.engine.module(input_ids=ids, use_cache=False).logits, {}
        with cast, windows_not_packed():
            out = self.engine.module(input_ids=ids, labels=ids, use_cache=False)
        return out.loss.float(), {}

    def report(self, step, logger) -> dict[str, float]:
        return {}

    def logits_fn(self):
        from s2t2_dist.eval.scoring import hf_logits_fn

        return hf_logits_fn(self.engine.module, self.engine.device, self.autocast)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        from s2t2_dist.eval.scoring import evaluate_documents

        if self.eval_docs is None:
            return {}
        metrics, _, _ = evaluate_documents(self.logits_fn(), self.eval_docs, self.cfg.train.context_len,
                                        vocab_size=self.plan.vocab_size, batch_size=self.cfg.eval.batch_size,
                                        pad_id=_pad(self.plan), max_docs=self.cfg.train.eval_max_docs)
        return metrics


@contextlib.contextmanager
def windows_not_packed():
    """Training windows hold one causal stream each (default positions, no per-document masking), so transformers'
    probe for packed sequences (masking_utils.find_packed_sequence_indices, called when no attention mask is given)
    always answers None -- after reading a device value back in a Python ``if``: one host sync per forward, which
    would keep a GPU from running ahead. The probe is skipped while the task's forward runs."""
    try:
        import transformers.masking_utils as mu
    except ImportError:  # an older transformers without the probe
        yield
        return
    real = getattr(mu, "find_packed_sequence_indices", None)
    if real is None:
        yield
        return
    mu.find_packed_sequence_indices = _no_packing
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = real


def _no_packing(position_ids):
    return None


def _pad(plan: InitPlan) -> int:
    return plan.pad_id if plan.pad_id is not None else plan.eos_id if plan.eos_id is not None else 0


# ----------------------------------------------------------------------------------------------------------------
# building


def build_model(cfg: FinetuneConfig, plan: InitPlan, rt: Runtime):
    """(the transformers model, the Engine) from the initial directory; under ZeRO-3 built into partitions.
    Finetuning keeps float32 master weights (train.precision selects the compute dtype)."""
    source = plan.model_dir
    if cfg.trainable == "embeddings":
        source = embeddings_only(build_causal_lm(source, dtype=torch.float32, device=rt.device,
                                                 trust_remote_code=cfg.model.trust_remote_code))
    model, engine = build_model_and_engine(cfg.engine, source, cfg.optim, cfg.train, device=rt.device,
                                           dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code)
    _set_special_ids(model, plan)
    return model, engine


def embeddings_only(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze everything but the input embedding and the output head (untied: a translated start is untied)."""
    E, L, tied = get_embedding_and_head(model)
    if tied:
        raise ConfigError("trainable=embeddings: the model's embedding and head are tied; a translated start "
                          "(init.kind=translated) unties them")
    for p in model.parameters():
        p.requires_grad_(p is E or p is L)
    return model


def _set_special_ids(model, plan: InitPlan) -> None:
    """The exported config and generation config carry the ids of the tokenizer the model speaks (the OLMo hub
    generation_config says eos 0, for instance)."""
    for obj in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if obj is None:
            continue
        for k, v in (("bos_token_id", plan.bos_id), ("eos_token_id", plan.eos_id), ("pad_token_id", plan.pad_id)):
            setattr(obj, k, v)


def build(cfg: FinetuneConfig, rt: Runtime, resolved: tuple[InitPlan, dict] | None = None):
    """(task, model, engine, loader, plan); ``resolved``: the run's one `resolve_plan` (None: resolved here)."""
    from s2t2_dist.data.global_loader import GlobalTrainLoader
    from s2t2_dist.data.reader import EvalDocs
    from s2t2_dist.stages.init_model import check_shards, prepare_initial_model

    env = rt.env
    init_dir = cfg.init.dir or str(rt.run_dir / "init")
    with phases.phase("initial model"):
        plan = prepare_initial_model(cfg.init, cfg.model.path, cfg.data.tokenizer, init_dir, is_main=env.is_main,
                                     trust_remote_code=cfg.model.trust_remote_code, resolved=resolved)
    # the data position is global (a sample count): a checkpoint resumes on another number of ranks
    cfg.train.resolve_layout(env.world_size)  # auto -> a number; ConfigError naming the keys if impossible
    with phases.phase("data"):
        loader = GlobalTrainLoader(cfg.data.train, global_batch_size=cfg.train.batch_size,
                                   micro_batch_size=cfg.train.micro_batch_size, rank=env.rank,
                                   world_size=env.world_size, num_workers=cfg.data.num_workers, seed=cfg.train.seed,
                                   shuffle_window=cfg.data.shuffle_window)
        check_shards(loader.manifest, plan, "data.train")
        checks.context_matches_shards(loader.manifest, cfg.train.context_len, "data.train")  # the shards read
        eval_docs = None
        if cfg.data.eval:
            eval_docs = EvalDocs(cfg.data.eval, rank=env.rank, world_size=env.world_size)
            check_shards(eval_docs.manifest, plan, "data.eval")
    model, engine = build_model(cfg, plan, rt)
    task = FinetuneTask(engine, rt, plan, cfg, eval_docs)
    return task, model, engine, loader, plan


# ----------------------------------------------------------------------------------------------------------------
# export


def export_model(engine, plan: InitPlan, out_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                 extra: dict | None = None) -> Path:
    """Write the current weights as a standard Hugging Face directory (config, safetensors, the tokenizer files of
    the tokenizer the model speaks), atomically (built in OUT.partial, then renamed). Collective."""
    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.stages.init_model import replace_dir
    from s2t2_dist.errors import InitError
    from s2t2_dist.data.tokenizers import copy_tokenizer_files
    from s2t2_dist.models.dir_check import write_record
    from s2t2_dist.utils.io import atomic_write_text, fsync_dir

    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    rank = coll.rank()
    if out.exists() and not (out / EXPORT_INFO).is_file():  # checked on every rank before any collective
        raise InitError(f"export.dir {out} exists and was not written by s2t2 (no {EXPORT_INFO}); choose another")
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)
    coll.barrier()
    engine.export_consolidated(partial, dtype=dtype)  # collective; rank 0 writes
    err = None
    if rank == 0:
        try:
            copy_tokenizer_files(plan.loaded["tokenizer"], partial)
            write_record(partial)  # checksums a later stage compares before reading the export
            atomic_write_text(partial / EXPORT_INFO, json.dumps({"init": plan.to_dict(), **(extra or {})}, indent=1))
            fsync_dir(partial)
            replace_dir(partial, out, EXPORT_INFO)
        except BaseException as e:  # noqa: BLE001 - raised on every rank
            from s2t2_dist.utils.io import write_error

            err = (write_error(partial, e) if isinstance(e, Exception) else None) or e
    coll.raise_if_any_failed(err, f"exporting {out}")
    return out


@torch.no_grad()
def probe_logits(task: FinetuneTask, n_tokens: int = 32, seed: int = 1234) -> dict:
    """Logits of the trained model (as the engine computes them) on fixed ids, to check an export against.
    Collective."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, task.plan.vocab_size, (2, min(n_tokens, task.cfg.train.context_len)), generator=g)
    task.engine.eval()
    logits = task.logits_fn()(ids).float().cpu()
    return {"input_ids": ids, "logits": logits}


# ----------------------------------------------------------------------------------------------------------------
# entry points


def preflight(cfg: FinetuneConfig) -> tuple[InitPlan, dict] | None:
    """What can be checked from files before any weight is read (see translate.preflight). Returns the run's
    `resolve_plan` (None for a hub model: resolved by the work; the shards against the tokenizer the model will
    speak are then checked by `build`, before the model is loaded)."""
    checks.run_dir(cfg.run_dir, stage="finetune")
    checks.export_dir(cfg.export.dir, cfg.run_dir)
    checks.writable_dirs({"init.dir": cfg.init.dir})
    checks.training_layout(cfg.train, cfg.data.eval)
    if cfg.trainable == "embeddings" and cfg.engine.kind != "plain":
        raise ConfigError(f"trainable=embeddings: needs engine.kind=plain (got {cfg.engine.kind}); the probe is a "
                          "small model's")
    mdir = checks.model_dir(cfg.model.path)
    src = checks.model_tokenizer(mdir, trust_remote_code=cfg.model.trust_remote_code)
    checks.model_tokenizer_fits(mdir, src)
    checks.context_fits(mdir, cfg.train.context_len, "train.context_len")
    train_m = checks.shards(cfg.data.train, "data.train", "packed")
    checks.context_matches_shards(train_m, cfg.train.context_len, "data.train")
    checks.batch_fits_shards(train_m, cfg.train.batch_size)
    tok = checks.tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
    if tok is not None:
        checks.shards_match_tokenizer(train_m, "data.train", tok)
    if cfg.data.eval:
        eval_m = checks.shards(cfg.data.eval, "data.eval", "docs")
        if tok is not None:
            checks.shards_match_tokenizer(eval_m, "data.eval", tok)
        checks.same_shards(train_m, eval_m)
    if cfg.init.kind == "translated":
        checks.input_file(cfg.init.p_file, "init.p_file")
    if mdir is not None:  # the tokenizer the model will speak (P file, init kind) against the shards: no weights read
        from s2t2_dist.stages.init_model import check_shards, resolve_plan

        resolved = resolve_plan(cfg.init, cfg.model.path, cfg.data.tokenizer,
                                cfg.init.dir or str(Path(cfg.run_dir) / "init"), target=tok, source=src)
        check_shards(train_m, resolved[0], "data.train")
        if cfg.data.eval:
            check_shards(eval_m, resolved[0], "data.eval")
        return resolved
    return None


def run(cfg: FinetuneConfig, *, progress: bool = True) -> dict:
    return run_stage(cfg, _train, preflight=preflight, precision=cfg.train.precision, seed=cfg.train.seed,
                     engine=cfg.engine, record=False, progress=progress, result=lambda rt: rt.run_dir / "result.json",
                     report=lambda rt, s: log.info("finetune: %s", json.dumps({k: v for k, v in s.items()
                                                                                 if k != "losses"})))


def _train(cfg: FinetuneConfig, rt: Runtime, resolved: tuple[InitPlan, dict] | None) -> dict:
    from s2t2_dist.stages.init_model import resolve_plan
    from s2t2_dist.train.checkpoint import Checkpointer
    from s2t2_dist.train.callbacks import final_evaluation
    from s2t2_dist.train.loop import train
    from s2t2_dist.utils.rundir import run_id

    # the checkpoint is checked against this config before the initial model is written or loaded
    resolved = resolved or resolve_plan(cfg.init, cfg.model.path, cfg.data.tokenizer,
                                        cfg.init.dir or str(rt.run_dir / "init"))
    plan = resolved[0]
    fp = fingerprint(**config_part(cfg, "model"), data=cfg.data.train, tokenizer=plan.tokenizer_hash,
                     engine=cfg.engine.kind, train=[cfg.train.batch_size, cfg.train.context_len, cfg.train.seed])
    fp["init"] = config_part(cfg, "init")["init"]  # by value: a refusal names the key (init.p_file, init.kind)
    fp["optim"] = cfg.optim.fingerprint()  # by value: a refusal names the changed setting
    fp["train.steps"] = cfg.train.steps  # the lr schedule's length: a change is refused, never silently applied
    fp["trainable"] = cfg.trainable  # which parameters the checkpoint holds
    # elastic: a checkpoint resumes on another number of ranks -- FSDP2 through torch DCP (which re-splits the
    # parameters and Adam moments over the new mesh), DeepSpeed through a universal checkpoint, the plain engine
    # from rank 0's replica
    ck = Checkpointer(rt.run_dir, keep=cfg.train.keep_checkpoints, fingerprint=fp, elastic=True)
    ck.check_resumable()
    record_config(rt, cfg)
    task, model, engine, loader, plan = build(cfg, rt, resolved)
    from s2t2_dist.train.flops import flops_per_token

    result = train(cfg.train, task, engine, loader, ck, rt.logger,
                   flops_per_token=flops_per_token(model, cfg.train.context_len), progress=rt.progress)
    summary: dict = {"step": result.step, "finished": result.finished, "preempted": result.preempted,
                     "bad_steps": result.bad_steps, "losses": result.losses,
                     "final_loss": result.final_loss,
                     "init": plan.to_dict(), "world_size": rt.env.world_size, "engine": cfg.engine.kind,
                     "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None}
    if result.finished:
        if task.eval_docs is not None:
            summary["eval"] = final_evaluation(result, task, engine, rt.logger)
        dtype = torch.float32 if cfg.export.dtype == "float32" else torch.bfloat16
        out = Path(cfg.export.dir or rt.run_dir / "final")
        probe = probe_logits(task)
        from s2t2_dist import faults
        from s2t2_dist.utils import stop

        with stop.deferred():  # a time-limit signal now lets the export complete, then the run exits 0
            faults.point("export.begin", result.step)
            export_model(engine, plan, out, dtype=dtype,
                         extra={"step": result.step, "eval": summary.get("eval"), "run_id": run_id(rt.run_dir)})
        summary["export"] = str(out)
        if rt.env.is_main:
            torch.save(probe, rt.run_dir / "export_probe.pt")
    return summary


def parse_config(argv: list[str]) -> FinetuneConfig:
    """The run config from the command line, launcher arguments included (`s2t2 submit` checks it with this)."""
    return parse_args(FinetuneConfig, argv, "s2t2 finetune")[0]


def main(argv: list[str]) -> int:
    def work() -> dict:
        cfg, args = parse_args(FinetuneConfig, argv, "s2t2 finetune")
        return run(cfg, progress=not args.no_progress)
    return run_main("s2t2 finetune", work)
