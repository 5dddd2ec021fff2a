"""The `engine:` section and the registry of engine kinds.

    engine:
      kind: deepspeed            # plain | deepspeed | fsdp
      ds_config: configs/ds_zero3.json
      activation_checkpointing: true

`engine_kind(cfg.engine.kind)` is the EngineKind (engines/base.py) holding that engine's decisions (distributed
start, autocast, model loading); `build_model_and_engine` gives (model, Engine) for the loop. A new engine: its
module (the Engine and its EngineKind) and one line in KINDS here. Launcher arguments
(`--ds_config`, `--local_rank`) are engines/launcher.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from s2t2_dist.errors import ConfigError
from s2t2_dist.engines.base import Engine, EngineKind
from s2t2_dist.registry import Registry

#: engine.kind -> "module:EngineKind subclass", imported when asked for (DeepSpeed loads only when used)
KINDS = Registry("engine kind", {
    "plain": "s2t2_dist.engines.torch_engine:Plain",
    "deepspeed": "s2t2_dist.engines.deepspeed_engine:DeepSpeed",
    "fsdp": "s2t2_dist.engines.fsdp_engine:FSDP2",
})


@dataclass
class EngineConfig:
    #: plain: TorchEngine (replicated params, DDP-style); deepspeed: ZeRO 1/2/3 from ds_config; fsdp: FSDP2
    kind: Literal[tuple(KINDS)] = "plain"  # type: ignore[valid-type]  (KINDS above)
    #: DeepSpeed JSON config (kind=deepspeed only); batch size, clipping and precision in it are derived
    ds_config: str | None = None
    #: nested keys merged over the DeepSpeed JSON (e.g. {"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    #: recompute each transformer block's activations in backward (transformers gradient checkpointing); auto: only
    #: when the model's states and activations would not fit in 85% of the GPU's memory (never on CPU)
    activation_checkpointing: bool | Literal["auto"] = "auto"
    #: finetuning's next-token loss over the vocabulary in chunks of this many positions (models/chunked_loss.py):
    #: no [tokens, vocab] logits and no float32 copy of them; 0: transformers' loss over the full logits
    loss_chunk_tokens: int = 2048
    #: torch.compile each transformer block's forward (plain, fsdp); the first step then includes the compile
    compile: bool = False
    #: optimizer states (and, ZeRO-3 / FSDP2, parameters) in CPU memory; deepspeed: fills offload_* when absent
    offload: bool = False
    #: FSDP2: free the gathered parameters of a block after its forward (ZeRO-3-like); False is ZeRO-2-like
    fsdp_reshard_after_forward: bool = True

    def validate(self) -> None:
        if self.compile and self.kind == "deepspeed":
            raise ConfigError("compile: engine.kind=deepspeed does not compile the blocks (ZeRO-3's parameter hooks "
                              "run inside them); use engine.kind=fsdp or plain, or compile=false")
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
        if self.activation_checkpointing not in (True, False, "auto"):
            raise ConfigError(f"activation_checkpointing: true, false or auto, got {self.activation_checkpointing!r}")
        if self.ds_config:
            other = ("FSDP2 already shards parameters, gradients and optimizer states the way ZeRO-3 does"
                     if self.kind == "fsdp" else "the plain engine replicates the model on every rank")
            raise ConfigError(
                f"ds_config: {self.ds_config} is a DeepSpeed config but engine.kind={self.kind} ({other}); "
                "remove engine.ds_config or set engine.kind=deepspeed"
            )
        if self.ds_overrides:
            raise ConfigError(f"ds_overrides: only used with engine.kind=deepspeed (kind={self.kind})")
        if self.loss_chunk_tokens < 0:
            raise ConfigError(f"loss_chunk_tokens: must be >= 0 (0: off), got {self.loss_chunk_tokens}")
        if self.kind == "plain" and self.offload:
            raise ConfigError("offload: the plain engine cannot offload; use engine.kind=deepspeed or fsdp")


def engine_kind(kind: str) -> EngineKind:
    return KINDS.load(kind, "engine.kind")()


def build_model_and_engine(engine_cfg: EngineConfig, source, optim_cfg, train_cfg, *,
                           device: torch.device | None = None, dtype: torch.dtype | None = None,
                           trust_remote_code: bool = False) -> tuple[torch.nn.Module, Engine]:
    """The model (from a transformers checkpoint directory, a PretrainedConfig, or an nn.Module already built) and
    its Engine, as engine.kind builds them (plain: a replica on `device` in `dtype`; deepspeed: under ZeRO-3 straight
    into partitions; fsdp: sharded). torch.distributed must be started (`engine_kind(kind).init_distributed()`).

    Returns (the underlying transformers model, engine); call the model through `engine.module`."""
    engine_cfg.validate()
    return engine_kind(engine_cfg.kind).build(engine_cfg, source, optim_cfg, train_cfg, device=device, dtype=dtype,
                                              trust_remote_code=trust_remote_code)

