"""The package's public face for code outside it: bench/, scripts and notebooks import what they use from here, by
name (``from s2t2_dist.api import TokenTranslator, load_p``), never from the modules where the names live, so the
package may move a name between its modules without its clients noticing. A name is resolved from its home module on
first use (PEP 562): importing this module imports nothing else, and a script pays only for the parts it reads.

The names, by part (each part's modules document them). Eight modules are public as modules: the CUDA kernels'
seams, which a bench swaps for variants within ``kernels_as``: ``dykstra_triton``, ``triton_kernels``,
``product_triton``, ``product``; the start-up phase timer (``phases``); the environment variables (``envvars``), the
stop requests a loop reads (``stop``) and the stages' input checks (``stage_checks``). tests/project/test_layout.py
keeps bench/ and the recipes on this API and checks every name here resolves to its home."""

from __future__ import annotations

import importlib

#: public name -> its home module (a name that is a module maps to itself)
_HOME: dict[str, str] = {
    # optimal-transport math: the Dykstra steps, the CUDA kernels' seams, the first-use check, the starting plans
    "dykstra": "s2t2_dist.ot.dykstra",
    "newton_thresholds": "s2t2_dist.ot.dykstra",
    "TorchSteps": "s2t2_dist.ot.dykstra",
    "dry_run": "s2t2_dist.ot.dykstra_triton",
    "dykstra_triton": "s2t2_dist.ot.dykstra_triton",
    "TritonSteps": "s2t2_dist.ot.dykstra_triton",
    "check_problem": "s2t2_dist.ot.kernel_check",
    "launch_findings": "s2t2_dist.ot.kernel_check",
    "verdict": "s2t2_dist.ot.kernel_check",
    "blend_with_uniform": "s2t2_dist.ot.prior",
    "fvt_plan": "s2t2_dist.ot.prior",
    "row_marginal": "s2t2_dist.ot.prior",
    "shared_rows": "s2t2_dist.ot.prior",
    "start_plan": "s2t2_dist.ot.prior",
    "kernels_why_not": "s2t2_dist.ot.routing",
    "steps_for": "s2t2_dist.ot.routing",
    "triton_kernels": "s2t2_dist.ot.triton_kernels",
    # the token translator: P from C, its start, statistics, P files, the product over P
    "floor_plan_reference": "s2t2_dist.translator.floor",
    "REGISTRY": "s2t2_dist.translator.kinds",
    "TokenTranslator": "s2t2_dist.translator.module",
    "translated_rows": "s2t2_dist.translator.module",
    "translation_weights": "s2t2_dist.translator.module",
    "load_p": "s2t2_dist.translator.pfile",
    "save_p": "s2t2_dist.translator.pfile",
    "SparseP": "s2t2_dist.translator.pfile",
    "plan_product": "s2t2_dist.translator.product",
    "product": "s2t2_dist.translator.product",
    "product_triton": "s2t2_dist.translator.product_triton",
    "TranslatorConfig": "s2t2_dist.translator.recipe",
    "start_translator": "s2t2_dist.translator.start",
    "surface_decomposition": "s2t2_dist.translator.start",
    "surface_prior": "s2t2_dist.translator.start",
    "column_split": "s2t2_dist.translator.stats",
    "PStats": "s2t2_dist.translator.stats",
    "unbuilt_columns": "s2t2_dist.translator.stats",
    # data: FASTA, tokenizers, BPE, shards, splits, loaders
    "build_bpe_tokenizer": "s2t2_dist.data.bpe",
    "save_tokenizer_dir": "s2t2_dist.data.bpe",
    "train_tokenizer": "s2t2_dist.data.bpe",
    "DataConfig": "s2t2_dist.data.config",
    "read_fasta": "s2t2_dist.data.fasta",
    "GlobalTrainLoader": "s2t2_dist.data.global_loader",
    "prepare": "s2t2_dist.data.pipeline",
    "format_records": "s2t2_dist.data.raw_eval",
    "tokenize_files": "s2t2_dist.data.raw_eval",
    "EvalDocs": "s2t2_dist.data.reader",
    "RecordPolicy": "s2t2_dist.data.records",
    "write_shards": "s2t2_dist.data.shards",
    "iter_split_texts": "s2t2_dist.data.split",
    "split_dataset": "s2t2_dist.data.split",
    "load_hf_tokenizer": "s2t2_dist.data.tokenizers",
    "load_tokenizer": "s2t2_dist.data.tokenizers",
    "source_surface_bytes": "s2t2_dist.data.tokenizers",
    "source_token_ids": "s2t2_dist.data.tokenizers",
    "token_bytes": "s2t2_dist.data.tokenizers",
    "tokenizer_hash": "s2t2_dist.data.tokenizers",
    "byte_level_decoder": "s2t2_dist.data.tokenizers",
    "load_model_tokenizer": "s2t2_dist.data.tokenizers",
    "load_manifest": "s2t2_dist.data.shards",
    "ShardReader": "s2t2_dist.data.reader",
    "split_of": "s2t2_dist.data.split",
    # models: loading, embeddings and head, the translated LM
    "asset_path": "s2t2_dist.models.hf",
    "build_causal_lm": "s2t2_dist.models.hf",
    "get_embedding_and_head": "s2t2_dist.models.hf",
    "load_causal_lm": "s2t2_dist.models.hf",
    "local_numel": "s2t2_dist.models.hf",
    "transformer_blocks": "s2t2_dist.models.hf",
    "materialize": "s2t2_dist.models.translated",
    "TranslatedLM": "s2t2_dist.models.translated",
    "RECORD": "s2t2_dist.models.dir_check",
    "verify_record": "s2t2_dist.models.dir_check",
    "write_record": "s2t2_dist.models.dir_check",
    # scoring: bits per byte and perplexity of documents
    "score_documents": "s2t2_dist.eval.bpb",
    "evaluate_documents": "s2t2_dist.eval.scoring",
    "hf_logits_fn": "s2t2_dist.eval.scoring",
    "score_documents_batched": "s2t2_dist.eval.scoring",
    "claim": "s2t2_dist.eval.paired",
    "paired_difference": "s2t2_dist.eval.paired",
    # training: the loop, its config, optimiser, checkpoints, metrics
    "Checkpointer": "s2t2_dist.train.checkpoint",
    "OptimConfig": "s2t2_dist.train.config",
    "TrainConfig": "s2t2_dist.train.config",
    "SYNC_DEBUG_ENV": "s2t2_dist.train.loop",
    "Task": "s2t2_dist.train.loop",
    "train": "s2t2_dist.train.loop",
    "MetricsLogger": "s2t2_dist.train.metrics",
    "phases": "s2t2_dist.train.phases",
    # engines: plain, DeepSpeed ZeRO-3, FSDP2
    "build_model_zero3": "s2t2_dist.engines.deepspeed_engine",
    "DeepSpeedEngine": "s2t2_dist.engines.deepspeed_engine",
    "init_deepspeed_distributed": "s2t2_dist.engines.deepspeed_engine",
    "partitioned_numel": "s2t2_dist.engines.deepspeed_engine",
    "resolve_ds_config": "s2t2_dist.engines.deepspeed_engine",
    "FSDP2Engine": "s2t2_dist.engines.fsdp_engine",
    "TorchEngine": "s2t2_dist.engines.torch_engine",
    "engine_overrides": "s2t2_dist.engines.launcher",
    "EngineConfig": "s2t2_dist.engines.build",
    "engine_kind": "s2t2_dist.engines.build",
    # distributed: process groups, the sharded Sinkhorn's counters
    "init_distributed": "s2t2_dist.distributed.env",
    "CommStats": "s2t2_dist.distributed.sharded_sinkhorn",
    # the stages: configs, Tasks, stage 2's translated initialisation, their checks, error handling and commands
    "EvaluateConfig": "s2t2_dist.stages.evaluate",
    "FinetuneConfig": "s2t2_dist.stages.finetune",
    "FinetuneTask": "s2t2_dist.stages.finetune",
    "translated_embeddings": "s2t2_dist.stages.init_model",
    "TranslateConfig": "s2t2_dist.stages.translate",
    "TranslateTask": "s2t2_dist.stages.translate",
    "cpu_computes_bf16": "s2t2_dist.stages.common",
    "report_user_error": "s2t2_dist.stages.common",
    "run_main": "s2t2_dist.stages.common",
    "stage_checks": "s2t2_dist.stages.checks",
    "writable_dir": "s2t2_dist.stages.checks",
    "COMMANDS": "s2t2_dist.cli",
    # recipes: source models, the runner, shipped small models, data preparation
    "write_config": "s2t2_dist.recipes.demo",
    "save_hf": "s2t2_dist.recipes.llama2c",
    "prepare_protein": "s2t2_dist.recipes.orchestrate",
    "quiet_process_env": "s2t2_dist.recipes.orchestrate",
    "Runner": "s2t2_dist.recipes.orchestrate",
    "stories260k": "s2t2_dist.recipes.orchestrate",
    "tb_scalars": "s2t2_dist.recipes.orchestrate",
    "unigram_reference": "s2t2_dist.recipes.orchestrate",
    "residue_frequencies": "s2t2_dist.recipes.reproduce_lm",
    "smollm2": "s2t2_dist.recipes.smollm2",
    "real_config_dict": "s2t2_dist.recipes.tiny",
    "save_olmo_tokenizer": "s2t2_dist.recipes.tiny",
    "save_tiny": "s2t2_dist.recipes.tiny",
    "tiny_config": "s2t2_dist.recipes.tiny",
    "tiny_from_config": "s2t2_dist.recipes.tiny",
    # utilities: atomic files, run-directory locks, stop requests, routes taken, host-sync counting
    "atomic_write_json": "s2t2_dist.utils.io",
    "sha256_file": "s2t2_dist.utils.io",
    "atomic_dir": "s2t2_dist.utils.io",
    "atomic_open": "s2t2_dist.utils.io",
    "atomic_write_text": "s2t2_dist.utils.io",
    "build_lock": "s2t2_dist.utils.io",
    "write_error": "s2t2_dist.utils.io",
    "lock": "s2t2_dist.utils.rundir",
    "stop": "s2t2_dist.utils.stop",
    "fallbacks": "s2t2_dist.utils.routes",
    "record": "s2t2_dist.utils.routes",
    "summary": "s2t2_dist.utils.routes",
    "text": "s2t2_dist.utils.routes",
    "count_host_syncs": "s2t2_dist.utils.syncs",
    # the package's top level: errors, the config system, environment variables
    "load_config": "s2t2_dist.config",
    "PFileError": "s2t2_dist.errors",
    "apply_overrides": "s2t2_dist.config",
    "config_from_dict": "s2t2_dist.config",
    "save_config": "s2t2_dist.config",
    "to_dict": "s2t2_dist.config",
    "config_rows": "s2t2_dist.config_docs",
    "envvars": "s2t2_dist.envvars",
    "ConfigError": "s2t2_dist.errors",
    "DataError": "s2t2_dist.errors",
    "SourceModelError": "s2t2_dist.errors",
    "UserError": "s2t2_dist.errors",
}

#: the names that are modules
_MODULES = frozenset({"dykstra_triton", "envvars", "phases", "product", "product_triton", "stage_checks", "stop",
                      "triton_kernels"})

__all__ = sorted(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    mod = importlib.import_module(home)
    value = mod if name in _MODULES else getattr(mod, name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return __all__
