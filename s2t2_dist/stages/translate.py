"""Stage 1, translate: learn P through a frozen causal LM, C sharded column-wise across ranks.

    torchrun --nproc_per_node 2 launch/translate.py --config configs/translate_olmo1b.yaml train.steps=100
    sbatch slurm/translate_1b.sh

Every rank holds the frozen LM (data parallel over batches) and the columns of C of its target tokens; the
translator builds the full E' and L' on every rank from the local columns by a gather, so the LM runs unchanged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch

from s2t2_dist.errors import ConfigError
from s2t2_dist.eval.scoring import ScoringConfig
from s2t2_dist.data.config import DataPaths
from s2t2_dist.models.hf import ModelPathConfig
from s2t2_dist.stages import checks
from s2t2_dist import faults
from s2t2_dist.utils import stop
from s2t2_dist.stages.common import (Runtime, config_part, fingerprint, parse_args, record_config, run_main,
                                     run_stage)
from s2t2_dist.train.config import TrainConfig
import s2t2_dist.train.phases as phases
from s2t2_dist.train.loop import Task
from s2t2_dist.translator.recipe import Resolved, TranslateOptimConfig, TranslatorConfig
from s2t2_dist.translator.stats import PStats, p_sparsity, sparsity_warning

log = logging.getLogger("s2t2.translate")


@dataclass
class ModelConfig(ModelPathConfig):
    """The `model:` section (path, trust_remote_code: ModelPathConfig, shared with finetune and evaluate) and what
    stage 1 adds: source tokens, activation checkpointing and partitioning."""

    #: source tokens P translates from: all (every real token), single_byte (one byte: the paper's "bytes"),
    #: single_char (one character, often several bytes), or a file of ids (docs/translator.md)
    source_vocab: str = "all"
    #: recompute each block's activations in backward (less memory, about a third more compute)
    activation_checkpointing: bool = False
    #: none: the frozen LM replicated on every rank; fsdp: its transformer blocks partitioned across ranks
    #: (FSDP2, gathered block by block in forward and backward) for models that do not fit one device
    partition: Literal["none", "fsdp"] = "none"

    #: keys that no longer exist -> what to write instead (config.py reports them in one line)
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "dtype": "it was never read: the frozen LM computes in train.precision (bf16 or fp32); remove the key"}


@dataclass
class TranslateConfig:
    #: run directory: checkpoints, P.safetensors, TensorBoard logs (tb/), the resolved config.yaml
    run_dir: str = "runs/translate"
    #: the frozen source LM
    model: ModelConfig = field(default_factory=ModelConfig)
    #: target-domain shards and tokenizer written by `s2t2 prepare`
    data: DataPaths = field(default_factory=DataPaths)
    #: how P is parameterised and regularised
    translator: TranslatorConfig = field(default_factory=TranslatorConfig)
    #: AdamW and its learning-rate schedule (stage 1 trains only P's parameters; lr absolute, null: the kind's)
    optim: TranslateOptimConfig = field(default_factory=lambda: TranslateOptimConfig(weight_decay=0.0))
    #: steps, batch layout, precision, logging, evaluation and checkpoint cadence
    train: TrainConfig = field(default_factory=TrainConfig)
    #: held-out evaluation on data.eval (the documents: train.eval_max_docs)
    eval: ScoringConfig = field(default_factory=ScoringConfig)

    def describe_resolved(self) -> tuple[dict, str]:
        """What `s2t2 config translate` can resolve without the model (the translator's recipe) and a note on
        what waits for it."""
        return self.translator.describe(self.optim.lr), ("v, the source vocabulary, is read from model.path "
                                                         "(model.source_vocab) and u from data.tokenizer when the "
                                                         "run starts")


class TranslateTask(Task):
    """Loss of a micro-batch through the frozen LM reading and predicting target tokens via E', L'."""

    def __init__(self, lm, translator, E, L, src_ids, cfg: TranslateConfig, rt: Runtime, target_vocab: list[str],
                 source_vocab: list[str], eval_docs=None, resolved: Resolved | None = None):
        self.lm, self.translator = lm, translator
        self.stats = PStats(translator)  # P's statistics and the monitor of C's gradient
        self.stats.watch_grad()
        self.E, self.L, self.src_ids = E, L, src_ids
        translator.register_source_ids(src_ids)  # (setup: its one host read is not a step's)
        self.cfg, self.rt = cfg, rt
        self.resolved = (resolved if resolved is not None
                         else cfg.translator.resolve(translator.v, translator.u, lr=cfg.optim.lr))
        self.alpha = self.resolved.alpha
        self.target_vocab, self.source_vocab = target_vocab, source_vocab
        self.eval_docs = eval_docs
        self.frozen_at = None
        self.start_warning = self.resolved.freeze_warning(translator.mu)
        self.lr = self.resolved.lr

    def embeddings(self):
        E_new, L_new = self.translator.embed_and_head(self.E, self.L, self.src_ids)
        dt = self.E.dtype
        return E_new.to(dt), L_new.to(dt)

    before_step_phase = "plan"

    def before_step(self, steps_done: int, logging: bool) -> None:
        """One plan per optimiser step: P, E', L' (and H) computed once for all the step's micro-batches
        (TokenTranslator.begin_step)."""
        self.translator.begin_step(self.E, self.L, self.src_ids, entropy=bool(self.alpha))
        self._unsampled += 1

    def after_backward(self, logging: bool) -> None:
        """The step's one backward into C; on logging steps the gradient monitor samples C's final gradient (on
        the device: read in report())."""
        self.translator.finish_step()
        if logging:
            self.stats.end_step(self._unsampled)
            self._unsampled = 0

    _unsampled = 0  # optimiser steps since the gradient monitor's last sample

    def state_dict(self) -> dict:
        """The gradient monitor's last sample and the freeze it saw: a run resumed at its last step (nothing left
        to train) reports the gradient of the run, not of no step."""
        return {"grad_monitor": self.stats.monitor_state(), "frozen_at": self.frozen_at, "unsampled": self._unsampled}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_monitor_state(state.get("grad_monitor") or {})
        self.frozen_at = state.get("frozen_at")
        self._unsampled = int(state.get("unsampled", 0))

    def parameters_finite(self):
        """C after the update (this rank's columns), checked like the loss: a NaN in C would make every later P
        NaN, and the run would end as 'too many bad steps' with the cause long past."""
        return torch.isfinite(self.translator.C).all()

    def loss(self, batch):
        ids = batch["input_ids"]
        if ids.numel() and ids.device.type == "cpu":  # the host batch, read through numpy: no torch op, no sync
            a = ids.numpy()
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= len(self.target_vocab):
                from s2t2_dist.errors import DataError

                # the manifest named this tokenizer (checked before work), the shards' ids do not fit it
                raise DataError(f"data.train: a batch holds token ids in [{lo}, {hi}], outside the {len(self.target_vocab)}"
                                f"-token tokenizer data.tokenizer (the shards were written with another tokenizer than "
                                f"their manifest names); prepare the shards again with data.tokenizer")
        ids = ids.to(self.rt.device, non_blocking=True)
        E_new, L_new = self.embeddings()
        with torch.autocast(self.rt.device.type, dtype=torch.bfloat16, enabled=self.rt.dtype == torch.bfloat16):
            out = self.lm(ids, E_new=E_new, L_new=L_new)
        loss = out.loss.float()
        extra = {"ce": loss.detach()}  # a tensor: the loop reads it on logging steps only
        if self.alpha:  # the global H on every rank: the loss (and what is logged) is the same at any rank count
            reg = self.alpha * self.translator.entropy()
            extra["alpha*H"] = reg.detach()  # the loss's second part, named wherever the loss is shown
            loss = loss + reg
        return loss, extra

    @torch.no_grad()
    def report_stats(self, step, logger, batch):
        """The logging step's diagnostics in the loop's one collective: registers this rank's partial values of
        every statistic of P and of the gradient monitor into ``batch`` (the loop's StatsBatch, reduced once with
        its own numbers) and returns what turns the reduced host values into the logged scalars (it also writes the
        heatmap and the top translations on rank 0; no collective, no device read)."""
        tr = self.stats
        P = self.translator.P()
        parts = [tr.add_density(batch, P), tr.add_marginals(batch, P)]
        entropy = tr.add_entropy(batch, P)
        mass, grad = tr.add_mass(batch, P), tr.add_grad(batch)
        top, block = tr.add_top(batch, 3, P), tr.add_block(batch, *self.cfg.translator.heatmap, P)

        def finish(r) -> dict[str, float]:
            stats = {f"P/{k}": v for part in parts for k, v in part(r).items()}
            stats["P/entropy"] = entropy(r)
            stats.update({f"P/{k}": v for k, v in mass(r).items()})
            stats.update(self.check_gradient(step, grad(r)))
            if self.rt.env.is_main:
                logger.heatmap(step, "P/heatmap", block(r))
                lines = ["| target | top source tokens (P / nu) |", "|---|---|"]
                for j, pairs in list(top(r).items())[:64]:
                    srcs = ", ".join(f"`{self.source_vocab[i]!r}` {w:.2f}" for i, w in pairs)
                    lines.append(f"| `{self.target_vocab[j]!r}` | {srcs} |")
                logger.text(step, "P/top_translations", "\n".join(lines))
            return stats
        return finish

    def report(self, step, logger) -> dict[str, float]:
        """:meth:`report_stats` on a batch of its own (collective: every rank calls it)."""
        batch = self.stats.stats_batch()
        return self.report_stats(step, logger, batch)(batch.reduce())

    def check_gradient(self, step: int, g: dict[str, float] | None = None) -> dict[str, float]:
        """The gradient monitor's global statistics ``g`` (None: read them, a collective); warns once (rank 0) when
        the gradient on C has been (almost) zero for translator.freeze_steps consecutive steps, and remembers it
        for the summary."""
        g = self.stats.grad_stats() if g is None else g
        n = self.cfg.translator.freeze_steps
        if n and g["grad_frozen_steps"] >= n and self.frozen_at is None:
            self.frozen_at = step
            if self.rt.env.is_main:
                log.warning("translate: the gradient on C has been (almost) exactly zero for %d steps (step %d): "
                            "P is frozen and no longer learns (the supports of the sparse projections collapsed; lower optim.lr, "
                            "or null for the kind's default)", int(g["grad_frozen_steps"]), step)
        return {f"C/{k}": v for k, v in g.items()}

    def gradient_summary(self, step: int, g: dict[str, float] | None = None) -> dict:
        g = self.check_gradient(step, g)
        return {"frozen": self.frozen_at is not None, "frozen_at_step": self.frozen_at,
                "frozen_steps_at_end": int(g["C/grad_frozen_steps"]), "live_grad_frac_at_end": g["C/grad_live_frac"],
                "lr": self.lr, "lr_x_v": self.lr * self.translator.v, "start_warning": self.start_warning}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """BpB of the current P on data.eval through the lock-step scorer of stage 2: the documents of global index
        < train.eval_max_docs (the same set at any rank count), every rank making the same number of forward calls
        (the blocks' all-gathers pair up when model.partition=fsdp). Collective."""
        from s2t2_dist.eval.scoring import evaluate_documents

        if self.eval_docs is None:
            return {}
        E_new, L_new = self.embeddings()  # a gather of C's columns: every rank
        fn, device = self.lm.logits_fn(E_new, L_new), self.rt.device
        metrics, _, _ = evaluate_documents(lambda ids: fn(ids.to(device)), self.eval_docs, self.cfg.train.context_len,
                                        vocab_size=len(self.target_vocab), batch_size=self.cfg.eval.batch_size,
                                        max_docs=self.cfg.train.eval_max_docs)
        return metrics


def checkpoint_frozen_blocks(model) -> int:
    """Make HF activation checkpointing act on a frozen model kept in eval mode: transformers recomputes a block
    only while that block's own `training` flag is set, so the flag is set on the blocks alone; their children
    (attention, MLP, dropout modules) stay in eval mode, so dropout stays off whatever the config says. Returns the
    number of blocks; 0 blocks that checkpoint is an error, not a silent no-op."""
    from s2t2_dist.models.hf import transformer_blocks

    blocks = [b for b in transformer_blocks(model) if getattr(b, "gradient_checkpointing", False)]
    if not blocks:
        raise ConfigError(f"model.activation_checkpointing: {type(model).__name__} has no transformers "
                          "checkpointing blocks (GradientCheckpointingLayer)")
    for b in blocks:
        b.training = True  # not b.train(): that would switch its children (and their dropout) to training mode
    return len(blocks)


def _vocab_strings(tok, ids) -> list[str]:
    return [tok.convert_ids_to_tokens(int(i)) or str(int(i)) for i in ids]


def build(cfg: TranslateConfig, rt: Runtime, inputs: TranslateInputs | None = None):
    """(task, engine, loader, tokenizer hashes); ``inputs``: what pre-flight read (None: read here)."""
    from s2t2_dist.data.tokenizers import source_token_ids
    from s2t2_dist.data.global_loader import GlobalTrainLoader
    from s2t2_dist.data.reader import EvalDocs
    from s2t2_dist.models.hf import (UnsupportedModel, check_finite_embeddings, fully_shard_blocks,
                                     get_embedding_and_head, load_causal_lm, local_numel)
    from s2t2_dist.models.translated import TranslatedLM
    from s2t2_dist.translator.start import start_translator, surface_decomposition
    from s2t2_dist.translator.stats import translator_column_split, unbuilt_columns
    from s2t2_dist.translator.product import record_route

    env = rt.env
    with phases.phase("model load"):
        model = load_causal_lm(cfg.model.path, dtype=rt.dtype, device=rt.device, frozen=True,
                               trust_remote_code=cfg.model.trust_remote_code)
    inputs = (inputs or TranslateInputs()).complete(cfg)
    src_tok = inputs.source.hf  # transformers' tokenizer of the model: names and BOS / EOS ids
    try:
        E, L, tied = get_embedding_and_head(model)
        TranslatedLM(model, freeze_model=False)  # checks the body and the logits (no state: dropped)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"model.path={cfg.model.path}: {e}") from None
    check_finite_embeddings(E, L, f"model.path={cfg.model.path}")
    if cfg.model.partition == "fsdp" and env.distributed:
        # Only the blocks are sharded: the translator reads E and L whole (they are the small part of the model),
        # and the LM's own embedding/head modules are never called (TranslatedLM feeds E' and applies L').
        fully_shard_blocks(model, reshard_after_forward=True)
    local, total = local_numel(model)
    src_ids = source_token_ids(src_tok, cfg.model.source_vocab, num_embeddings=E.shape[0]).to(rt.device)
    tgt = inputs.target
    u = tgt.vocab_size
    from s2t2_dist.distributed.collectives import group_for

    # C's columns are sharded over every rank, on the group that serves C's device (NCCL for CUDA)
    group = group_for(rt.device) if env.distributed else None
    tc = cfg.translator
    with phases.phase("translator"):
        translator, dec, resolved = start_translator(cfg.translator, cfg.model.path, src_tok, src_ids.tolist(), tgt,
                                                     lr=cfg.optim.lr, trust_remote_code=cfg.model.trust_remote_code,
                                                     group=group, device=rt.device)
    hashes = inputs.hashes()
    if cfg.translator.init_p:
        p = inputs.init_p
        p.check_compatible(hashes["source"], hashes["target"], where=f"{cfg.translator.init_p}: ")
        translator.init_from_dense(p.dense())
    elif dec is not None:
        log.info("translate: FVT start (weight %.3g, source marginal %s): %.1f%% of target bytes covered by source "
                 "tokens, %d target tokens without pieces, %d identical to a source token", tc.init_weight,
                 resolved.source_marginal, 100 * dec.coverage, dec.empty, dec.identical)
    lm = TranslatedLM(model, freeze_model=True, gradient_checkpointing=cfg.model.activation_checkpointing)
    if cfg.model.activation_checkpointing:
        checkpoint_frozen_blocks(model)
    from s2t2_dist.engines.torch_engine import TorchEngine

    with phases.phase("optimiser"):
        engine = TorchEngine.build(translator, cfg.optim, cfg.train.steps, params="sharded", lr=resolved.lr)
    # The data position is global (a sample count), so that a checkpoint resumes on any number of ranks
    cfg.train.resolve_layout(env.world_size)  # auto -> a number; ConfigError naming the keys if impossible
    loader = GlobalTrainLoader(cfg.data.train, global_batch_size=cfg.train.batch_size,
                               micro_batch_size=cfg.train.micro_batch_size, rank=env.rank, world_size=env.world_size,
                               num_workers=cfg.data.num_workers, seed=cfg.train.seed,
                               shuffle_window=cfg.data.shuffle_window, return_index=True,
                               pin_memory=rt.device.type == "cuda")
    if loader.dropped_per_epoch and env.is_main:
        log.info("data: %d blocks of each epoch (fewer than one global batch of %d) are left out of that epoch; "
                 "the order changes every epoch", loader.dropped_per_epoch, cfg.train.batch_size)
    checks.context_matches_shards(loader.manifest, cfg.train.context_len, "data.train")  # the shards read
    eval_docs = EvalDocs(cfg.data.eval, rank=env.rank, world_size=env.world_size) if cfg.data.eval else None
    task = TranslateTask(lm, translator, E, L, src_ids, cfg, rt,
                         [tgt.tokenizer.id_to_token(i) or str(i) for i in range(u)],
                         _vocab_strings(src_tok, src_ids.tolist()), eval_docs, resolved)
    if task.start_warning and env.is_main:
        log.warning("translate: %s", task.start_warning)
    task.lm_param_fraction = local / total
    task.p_start = p_sparsity(task.stats)  # collective when sharded: every rank
    # the target columns no source piece builds (FVT gives them dense columns): P's density without them too
    task.unbuilt = unbuilt_columns((dec or surface_decomposition(src_tok, src_ids.tolist(), tgt)).pieces)
    task.p_start.update(translator_column_split(task.stats, task.unbuilt))
    with torch.no_grad():  # (the plan p_sparsity took, cached)
        record_route(translator.P(), translator.plan_kind.sparse_product)
    report_routes(rt, 0)
    if env.is_main:
        log.info("translate: resolved %s", json.dumps(resolved.as_dict()))
    return task, engine, loader, hashes


def report_routes(rt: Runtime, step: int) -> dict:
    """The routes the Sinkhorn and the product took on every rank (:mod:`s2t2_dist.utils.routes`; a collective),
    logged (a fallback as a warning) and written to TensorBoard's text by rank 0; returned for result.json."""
    from s2t2_dist.distributed.collectives import all_gather_object
    from s2t2_dist.utils import routes

    s = routes.merged(all_gather_object(routes.summary()))
    if rt.env.is_main:
        line = routes.text(s)
        (log.warning if routes.fallbacks(s) else log.info)("translate: routes: %s", line)
        rt.logger.text(step, "routes", line)
    return s


def export_p(path: Path, task: TranslateTask, hashes: dict) -> Path | None:
    from s2t2_dist.translator.pfile import SparseP, save_p

    tr = task.translator
    idx, vals = tr.gather_sparse()  # global COO on every rank
    if not task.rt.env.is_main:
        return None
    p = SparseP(idx.cpu(), vals.cpu(), tr.mu.cpu(), tr.nu.cpu(), task.src_ids.cpu(), hashes["source"],
                hashes["target"], kind=tr.kind, normalization=tr.normalization)
    return save_p(path, p)


@dataclass
class TranslateInputs:
    """What stage 1 reads before any weight, once per run: pre-flight reads it, the work uses it."""

    #: the source model's tokenizer (data.tokenizers.ModelTokenizer)
    source: object = None
    #: data.tokenizer (data.tokenizers.TokenizerInfo)
    target: object = None
    #: translator.init_p (pfile.SparseP), when given
    init_p: object = None

    def complete(self, cfg: TranslateConfig) -> TranslateInputs:
        """Read what pre-flight could not (a hub model's tokenizer); returns self."""
        from s2t2_dist.data.tokenizers import load_model_tokenizer, load_tokenizer

        if self.source is None:
            self.source = load_model_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        if self.target is None:
            self.target = load_tokenizer(cfg.data.tokenizer)
        if cfg.translator.init_p and self.init_p is None:
            from s2t2_dist.translator.pfile import load_p

            self.init_p = load_p(cfg.translator.init_p)
        return self

    def hashes(self) -> dict:
        """The tokenizers' hashes, as the P file records them: the source's of its tokenizer.json file, as the data
        pipeline hashes it for manifests (transformers may rebuild a hub tokenizer in memory, which would hash
        differently)."""
        return {"source": self.source.hash, "target": self.target.hash}


def preflight(cfg: TranslateConfig) -> TranslateInputs:
    """Everything checkable from files before any weight is read: the model directory, its tokenizer against its
    embedding rows and its positions against train.context_len, the shards against data.tokenizer and the
    context length, the eval split (not empty). Returns what it read (the tokenizers, the init_p file)."""
    checks.run_dir(cfg.run_dir, stage="translate")
    checks.training_layout(cfg.train, cfg.data.eval)
    mdir = checks.model_dir(cfg.model.path)
    src = checks.model_tokenizer(mdir, trust_remote_code=cfg.model.trust_remote_code)
    checks.model_tokenizer_fits(mdir, src)
    checks.source_vocab(cfg.model.source_vocab, src)
    checks.context_fits(mdir, cfg.train.context_len, "train.context_len")
    tok = checks.tokenizer(cfg.data.tokenizer)
    checks.plan_fits(len(src.ids()) if src is not None else 0, tok.vocab_size)
    train_m = checks.shards(cfg.data.train, "data.train", "packed")
    checks.shards_match_tokenizer(train_m, "data.train", tok)
    checks.context_matches_shards(train_m, cfg.train.context_len, "data.train")
    checks.batch_fits_shards(train_m, cfg.train.batch_size)
    if cfg.data.eval:
        eval_m = checks.shards(cfg.data.eval, "data.eval", "docs")
        checks.shards_match_tokenizer(eval_m, "data.eval", tok)
        checks.same_shards(train_m, eval_m)
    p = None
    if cfg.translator.init_p:
        checks.input_file(cfg.translator.init_p, "translator.init_p")
        from s2t2_dist.translator.pfile import load_p

        p = load_p(cfg.translator.init_p)
        if src is not None:
            p.check_compatible(src.hash, tok.hash, where=f"translator.init_p {cfg.translator.init_p}: ")
    return TranslateInputs(source=src, target=tok, init_p=p)


def run(cfg: TranslateConfig, *, progress: bool = True) -> dict:
    return run_stage(cfg, _train, preflight=preflight, precision=cfg.train.precision, seed=cfg.train.seed,
                     record=False, progress=progress, result=lambda rt: rt.run_dir / "result.json",
                     report=lambda rt, s: log.info("translate: %s", json.dumps(s)))


def record_resolved(rt: Runtime, cfg: TranslateConfig, resolved: Resolved) -> None:
    """RUN_DIR/config.yaml again (rank 0, atomic), the config as given (null: automatic) followed by what the run
    resolved them to, as YAML comments: the file still loads as the same config."""
    if not rt.env.is_main:
        return
    import yaml

    from s2t2_dist.config import to_dict
    from s2t2_dist.utils.io import atomic_write_text

    lines = yaml.safe_dump(resolved.as_dict(), sort_keys=False).splitlines()
    atomic_write_text(rt.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False)
                      + "# resolved (what this run uses; also in result.json):\n"
                      + "".join(f"#   {x}\n" for x in lines))


def _train(cfg: TranslateConfig, rt: Runtime, inputs: TranslateInputs | None) -> dict:
    from s2t2_dist.train.checkpoint import Checkpointer
    from s2t2_dist.translator.stats import translator_column_split
    from s2t2_dist.train.callbacks import final_evaluation
    from s2t2_dist.train.loop import train

    # the checkpoint is checked against this config before the model is loaded (hashes as build computes them)
    inputs = (inputs or TranslateInputs()).complete(cfg)
    hashes = inputs.hashes()
    # elastic: C's columns and their Adam moments are re-split, and the data position is global, so a checkpoint
    # resumes on any number of ranks (the global batch and the seed must stay)
    fp = fingerprint(**config_part(cfg, "model", "translator"), data=cfg.data.train,
                     tokenizers=hashes, train=[cfg.train.batch_size, cfg.train.seed])
    fp["optim"] = cfg.optim.fingerprint()  # by value: a refusal names the changed setting
    fp["train.steps"] = cfg.train.steps  # the lr schedule's length: a change is refused, never silently applied
    ck = Checkpointer(rt.run_dir, keep=cfg.train.keep_checkpoints, fingerprint=fp, elastic=True)
    ck.check_resumable()
    record_config(rt, cfg)
    task, engine, loader, hashes = build(cfg, rt, inputs)
    record_resolved(rt, cfg, task.resolved)
    result = train(cfg.train, task, engine, loader, ck, rt.logger, progress=rt.progress)
    batch = task.stats.stats_batch()  # the end's statistics in one collective
    grad, end = task.stats.add_grad(batch), p_sparsity(task.stats, batch)
    reduced = batch.reduce()
    summary = {"step": result.step, "finished": result.finished, "preempted": result.preempted,
               "bad_steps": result.bad_steps, "final_loss": result.final_loss,
               "resolved": task.resolved.as_dict(),
               "lm_param_fraction_per_rank": task.lm_param_fraction,
               "gradient_on_C": task.gradient_summary(result.step, grad(reduced)),
               "routes": report_routes(rt, result.step)}
    summary["P"] = {"start": task.p_start, "end": {**end(reduced),
                                                   **translator_column_split(task.stats, task.unbuilt)}}
    summary["P"]["warning"] = sparsity_warning(summary["P"]["start"], summary["P"]["end"], result.step)
    if summary["P"]["warning"] and rt.env.is_main:
        log.warning("translate: %s", summary["P"]["warning"])
    if result.finished:
        with stop.deferred():  # a time-limit signal now lets the export complete, then the run exits 0
            faults.point("export.begin", result.step)
            summary["p_file"] = str(export_p(rt.run_dir / "P.safetensors", task, hashes))
        if task.eval_docs is not None:
            summary["eval"] = final_evaluation(result, task, engine, rt.logger)
    return summary


def main(argv: list[str]) -> int:
    def work() -> dict:
        cfg, args = parse_args(TranslateConfig, argv, "s2t2 translate")
        return run(cfg, progress=not args.no_progress)
    return run_main("s2t2 translate", work)


def parse_config(argv: list[str]) -> TranslateConfig:
    """The run config from the command line (`s2t2 submit` checks it with this before queueing)."""
    return parse_args(TranslateConfig, argv, "s2t2 translate")[0]
