"""Choosing and building an engine from the run config.

    engine:
      kind: deepspeed            # plain | deepspeed | fsdp
      ds_config: configs/ds_zero3.json
      activation_checkpointing: true

`build_engine_from_config(cfg.engine, model, cfg.optim, cfg.train)` gives the Engine the loop drives. Command lines
typed for DeepSpeed (`deepspeed launch/finetune.py --ds_config configs/ds_zero3.json`, or DeepSpeed's own
`--deepspeed_config`, plus the `--local_rank=N` the deepspeed launcher appends) are turned into the same dotted
overrides by `parse_launcher_args`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from s2t2_dist.config import ConfigError
from s2t2_dist.engines.base import Engine

EngineKind = Literal["plain", "deepspeed", "fsdp"]


@dataclass
class EngineConfig:
    #: plain: TorchEngine (replicated params, DDP-style); deepspeed: ZeRO 1/2/3 from ds_config; fsdp: FSDP2
    kind: EngineKind = "plain"
    #: DeepSpeed JSON config (kind=deepspeed only); batch size, clipping and precision in it are derived
    ds_config: str | None = None
    #: nested keys merged over the DeepSpeed JSON (e.g. {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    #: recompute each transformer block's activations in backward (transformers gradient checkpointing)
    activation_checkpointing: bool = False
    #: optimizer states (and, ZeRO-3 / FSDP2, parameters) in CPU memory; deepspeed: fills offload_* when absent
    offload: bool = False
    #: FSDP2: free the gathered parameters of a block after its forward (ZeRO-3-like); False is ZeRO-2-like
    fsdp_reshard_after_forward: bool = True

    def validate(self) -> None:
        if self.kind == "deepspeed":
            if not self.ds_config:
                raise ConfigError(
                    "ds_config: engine.kind=deepspeed needs a DeepSpeed JSON config, e.g. engine.ds_config="
                    "configs/ds_zero3.json (or --ds_config PATH)"
                )
            from s2t2_dist.engines.deepspeed_engine import check_ds_config_file

            try:
                stage = check_ds_config_file(self.ds_config, self.ds_overrides)
            except ConfigError as e:
                raise ConfigError(f"ds_config: {e}") from None
            if self.offload and stage < 1:
                raise ConfigError(f"offload: needs ZeRO stage >= 1, {self.ds_config} has stage {stage}")
            return
        if self.ds_config:
            other = ("FSDP2 already shards parameters, gradients and optimizer states the way ZeRO-3 does"
                     if self.kind == "fsdp" else "the plain engine replicates the model on every rank")
            raise ConfigError(
                f"ds_config: {self.ds_config} is a DeepSpeed config but engine.kind={self.kind} ({other}); "
                "remove engine.ds_config or set engine.kind=deepspeed"
            )
        if self.ds_overrides:
            raise ConfigError(f"ds_overrides: only used with engine.kind=deepspeed (kind={self.kind})")
        if self.kind == "plain" and self.offload:
            raise ConfigError("offload: the plain engine cannot offload; use engine.kind=deepspeed or fsdp")


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise ConfigError("engine.activation_checkpointing needs a transformers model (gradient_checkpointing_enable)")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_engine(
    kind: EngineKind,
    model: torch.nn.Module,
    optim_cfg,
    train_cfg,
    ds_config_path: str | Path | dict | None = None,
    *,
    activation_checkpointing: bool = False,
    offload: bool = False,
    ds_overrides: dict | None = None,
    fsdp_reshard_after_forward: bool = True,
    params: Literal["sharded", "replicated"] = "replicated",
) -> Engine:
    """The Engine of `kind` over `model` with the run's optimiser (optim_cfg) and schedule length (train_cfg.steps).

    torch.distributed must already be initialised for multi-rank runs (for deepspeed: `init_deepspeed_distributed()`).
    For ZeRO-3 build the model with `build_model_zero3` first so that no rank holds all of it."""
    if kind == "plain":
        from s2t2_dist.engines.torch_engine import TorchEngine

        if ds_config_path is not None:
            raise ConfigError("a DeepSpeed config was given but the engine kind is plain")
        if activation_checkpointing:
            _enable_activation_checkpointing(model)
        return TorchEngine(
            model, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay, betas=optim_cfg.betas, eps=optim_cfg.eps,
            total_steps=train_cfg.steps, warmup_frac=optim_cfg.warmup_frac, final_frac=optim_cfg.final_lr_frac,
            grad_clip=optim_cfg.grad_clip, params=params,
        )
    if kind == "deepspeed":
        from s2t2_dist.engines.deepspeed_engine import DeepSpeedEngine

        if ds_config_path is None:
            raise ConfigError("engine kind deepspeed needs a DeepSpeed config (engine.ds_config / --ds_config PATH)")
        return DeepSpeedEngine(model, optim_cfg=optim_cfg, train_cfg=train_cfg, ds_config=ds_config_path,
                               ds_overrides=ds_overrides, offload=offload,
                               activation_checkpointing=activation_checkpointing)
    if kind == "fsdp":
        from s2t2_dist.engines.fsdp_engine import FSDP2Engine

        if ds_config_path is not None:
            raise ConfigError("a DeepSpeed config was given but the engine kind is fsdp")
        return FSDP2Engine(model, optim_cfg=optim_cfg, train_cfg=train_cfg,
                           activation_checkpointing=activation_checkpointing, offload=offload,
                           reshard_after_forward=fsdp_reshard_after_forward)
    raise ConfigError(f"engine kind {kind!r} is not one of plain, deepspeed, fsdp")


def build_engine_from_config(engine_cfg: EngineConfig, model: torch.nn.Module, optim_cfg, train_cfg) -> Engine:
    engine_cfg.validate()
    return build_engine(
        engine_cfg.kind, model, optim_cfg, train_cfg, engine_cfg.ds_config,
        activation_checkpointing=engine_cfg.activation_checkpointing, offload=engine_cfg.offload,
        ds_overrides=engine_cfg.ds_overrides or None, fsdp_reshard_after_forward=engine_cfg.fsdp_reshard_after_forward,
    )


def build_model_and_engine(engine_cfg: EngineConfig, model_source, optim_cfg, train_cfg, *,
                           dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, Engine]:
    """The finetune stage's one call: the model (from a transformers checkpoint directory, a PretrainedConfig, or an
    nn.Module already built) and its Engine. Under ZeRO-3 a path or config is built straight into partitions
    (build_model_zero3), so no rank ever holds the whole model. torch.distributed must be initialised
    (`init_deepspeed_distributed()` for kind=deepspeed, else s2t2_dist.dist.env.init_distributed()).

    Returns (the underlying transformers model, engine); call the model through `engine.module`."""
    engine_cfg.validate()
    if engine_cfg.kind == "deepspeed":
        from s2t2_dist.engines.deepspeed_engine import DeepSpeedEngine, build_model_zero3, resolve_ds_config

        if isinstance(model_source, torch.nn.Module):
            model, hidden = model_source, getattr(getattr(model_source, "config", None), "hidden_size", None)
        else:
            hidden = _hidden_size(model_source)
        ds_cfg = resolve_ds_config(engine_cfg.ds_config, train_cfg=train_cfg, optim_cfg=optim_cfg, hidden_size=hidden,
                                   offload=engine_cfg.offload, overrides=engine_cfg.ds_overrides or None)
        if not isinstance(model_source, torch.nn.Module):
            model = build_model_zero3(model_source, ds_cfg, dtype=dtype, seed=train_cfg.seed)
        engine = DeepSpeedEngine(model, optim_cfg=optim_cfg, train_cfg=train_cfg, ds_config=ds_cfg, resolved=True,
                                 activation_checkpointing=engine_cfg.activation_checkpointing)
        return engine.model, engine
    if isinstance(model_source, torch.nn.Module):
        model = model_source
    else:
        from transformers import AutoModelForCausalLM, PretrainedConfig

        if isinstance(model_source, PretrainedConfig):
            torch.manual_seed(train_cfg.seed)
            model = AutoModelForCausalLM.from_config(model_source)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_source), dtype=dtype or torch.float32)
    return model, build_engine_from_config(engine_cfg, model, optim_cfg, train_cfg)


def _hidden_size(model_source) -> int | None:
    from transformers import AutoConfig, PretrainedConfig

    cfg = model_source if isinstance(model_source, PretrainedConfig) else AutoConfig.from_pretrained(str(model_source))
    return getattr(cfg, "hidden_size", None)


# --------------------------------------------------------------------------------------------------------------
# command lines


@dataclass
class LauncherArgs:
    ds_config: str | None = None

    def overrides(self, section: str = "engine") -> list[str]:
        """Dotted overrides for the config system: a DeepSpeed config on the command line selects kind=deepspeed."""
        if self.ds_config is None:
            return []
        return [f"{section}.kind=deepspeed", f"{section}.ds_config={self.ds_config}"]


def parse_launcher_args(argv: list[str]) -> tuple[LauncherArgs, list[str]]:
    """Take `--ds_config PATH`, `--deepspeed_config PATH` (DeepSpeed's name), `--deepspeed PATH.json` (HF's name) and
    `--local_rank N` / `--local-rank=N` (appended by the deepspeed launcher) out of argv; return them and the rest."""
    out = LauncherArgs()
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        key, eq, val = a.partition("=")
        if key in ("--ds_config", "--ds-config", "--deepspeed_config", "--deepspeed-config"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{key} needs a path")
                val = argv[i + 1]
                i += 1
            if out.ds_config is not None and out.ds_config != val:
                raise ConfigError(f"two different DeepSpeed configs on the command line: {out.ds_config} and {val}")
            out.ds_config = val
        elif key == "--deepspeed":
            if eq:
                out.ds_config = val
            elif i + 1 < len(argv) and argv[i + 1].endswith(".json"):
                out.ds_config = argv[i + 1]
                i += 1
            # a bare --deepspeed flag (DeepSpeed's add_config_arguments) says nothing more
        elif key in ("--local_rank", "--local-rank"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{key} needs a value")
                val = argv[i + 1]
                i += 1
            # dropped: each rank takes its local rank from the environment (dist/env.py)
        else:
            rest.append(a)
        i += 1
    return out, rest
