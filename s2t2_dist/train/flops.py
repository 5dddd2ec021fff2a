"""Model FLOPs per token and the GPU peaks MFU is measured against (pure arithmetic; no device is touched here).

MFU = achieved model FLOPs / the GPU's dense bf16 peak, the PaLM convention that OLMo-core, torchtitan and
llm-foundry report: a training token costs 6 N FLOPs for the N weights its matmuls use (2 forward, 4 backward) plus
12 L d T for attention's scores and values (L layers, width d, sequence length T). Recomputation (activation
checkpointing) is not counted: it is the hardware's cost, not the model's.
"""

from __future__ import annotations

import torch

#: dense bf16 tensor-core peak in FLOP/s by a substring of torch.cuda.get_device_name(), most specific first
#: (vendor data sheets, without sparsity). A GPU that matches none has no MFU (the step-time line says so).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),     # SXM (HBM3): "NVIDIA H100 80GB HBM3"
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),     # SXM and PCIe
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)


def peak_flops(device_name: str | None) -> float | None:
    """The bf16 peak of a GPU by its name; None when the name is unknown (or there is no GPU)."""
    if not device_name:
        return None
    for key, peak in PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def matmul_params(model: torch.nn.Module) -> int:
    """Weights the matmuls of a token use: every parameter except the input embedding table (a lookup), which
    counts when it is also the output head (tied). Under ZeRO-3 a parameter's real size is ds_numel."""
    def numel(p):
        return int(getattr(p, "ds_numel", 0) or p.numel())

    total = sum(numel(p) for p in model.parameters())
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if get_in is not None else None
    head = get_out() if get_out is not None else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        if head is None or getattr(head, "weight", None) is not emb.weight:
            total -= numel(emb.weight)
    return total


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs of one token of a decoder of this model at sequence length ``seq_len`` (6 N + 12 L d T)."""
    cfg = getattr(model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    width = getattr(cfg, "hidden_size", 0) or 0
    return 6.0 * matmul_params(model) + 12.0 * layers * width * seq_len


def mfu(flops_per_tok: float, tokens_per_s_per_gpu: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None without a known peak)."""
    if not peak or flops_per_tok <= 0:
        return None
    return flops_per_tok * tokens_per_s_per_gpu / peak
