"""How a model is set up inside an engine, decided from the model and the run: activation checkpointing by memory
(engine.activation_checkpointing=auto), and the opt-in per-block torch.compile (engine.compile). Used by every
engine kind (engines/*_engine.py); the blocks themselves are models.hf.transformer_blocks."""

from __future__ import annotations

import torch

from s2t2_dist.models.hf import transformer_blocks

#: the share of a GPU's memory that the model's states and activations may fill before activation checkpointing
#: turns on (the rest: the allocator's fragmentation, the communication buffers, the CUDA context)
AUTO_CHECKPOINT_FILL = 0.85


def activation_memory(hf_config, micro_batch: int, context_len: int, loss_chunk: int = 0) -> float:
    """Bytes of a training step's saved activations without recomputation, bf16 (34 s b h per layer, Korthikanti
    et al. 2022, with the attention scores left to SDPA), plus the logits over the vocabulary: all of them (bf16,
    their float32 copy for the loss and its gradient) without a chunked loss, one float32 chunk and the kept
    gradients (hidden states bf16, the head float32) with one (models/chunked_loss.py)."""
    h = getattr(hf_config, "hidden_size", 0) or 0
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    vocab = getattr(hf_config, "vocab_size", 0) or 0
    tokens = micro_batch * context_len
    head = (8.0 * min(loss_chunk, tokens) * vocab + 2.0 * tokens * h + 4.0 * vocab * h if loss_chunk
            else 10.0 * tokens * vocab)
    return 34.0 * tokens * h * layers + head


def device_state_bytes(n_params: int, shards: int, offload: bool) -> float:
    """Bytes of the model's training states on each GPU: float32 weights, gradients and Adam moments (16 bytes a
    parameter, split over ``shards`` ranks); with ``offload`` they live in CPU memory (engine.offload: ZeRO-3's
    offload_param + offload_optimizer, FSDP2's CPUOffloadPolicy), and the GPU holds only the bf16 copy of the
    blocks being computed (a few blocks' bf16 weights: small beside the activations, not counted)."""
    if offload:
        return 0.0
    return 16.0 * n_params / max(shards, 1)


def wants_activation_checkpointing(setting, hf_config, n_params: int, micro_batch: int, context_len: int,
                                   shards: int, loss_chunk: int = 0, offload: bool = False) -> bool:
    """engine.activation_checkpointing resolved: auto is on when the training states held on the GPU
    (:func:`device_state_bytes`: none with ``offload``) and the step's activations exceed AUTO_CHECKPOINT_FILL of
    the GPU's memory (OLMo-1B, micro-batch 16 x 512 on one 80 GB GPU: 19 + 13 GB, off; OLMo-7B on one: on; OLMo-7B
    offloaded on one: its activations alone decide)."""
    if setting != "auto":
        return bool(setting)
    if not torch.cuda.is_available():
        return False  # on a CPU the memory is the host's and recomputation only costs time
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    need = device_state_bytes(n_params, shards, offload) + activation_memory(hf_config, micro_batch, context_len,
                                                                               loss_chunk)
    return need > AUTO_CHECKPOINT_FILL * total


def checkpointing_for(cfg, model: torch.nn.Module, train_cfg, *, sharded: bool) -> bool:
    """Whether ``model`` recomputes its blocks' activations under this engine (said on rank 0 when auto decides)."""
    from s2t2_dist.distributed import collectives as coll

    n = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in model.parameters())
    micro = train_cfg.micro_batch_size if isinstance(train_cfg.micro_batch_size, int) else 1
    on = wants_activation_checkpointing(cfg.activation_checkpointing, getattr(model, "config", None), n, micro,
                                        train_cfg.context_len, coll.world_size() if sharded else 1,
                                        getattr(cfg, "loss_chunk_tokens", 0), bool(getattr(cfg, "offload", False)))
    if cfg.activation_checkpointing == "auto" and coll.rank() == 0:
        import logging

        logging.getLogger("s2t2.engine").info("engine.activation_checkpointing=auto: %s (%.2f B parameters, "
                                              "micro-batch %d x %d)", "on" if on else "off", n / 1e9, micro,
                                              train_cfg.context_len)
    return on


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each transformer block's forward in place (names, hooks and sharding stay the module's: FSDP2's
    hooks run around the compiled forward, as in torchtitan's per-block compile); returns the blocks compiled."""
    blocks = transformer_blocks(model)
    for b in blocks:
        b.forward = torch.compile(b.forward)
    return len(blocks)
