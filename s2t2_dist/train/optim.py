"""Optimiser and schedule of the paper: AdamW (0.9, 0.95, eps 1e-5), cosine with linear warm-up to a floor."""

from __future__ import annotations

import math
from typing import Iterable

import torch


def cosine_lr_factor(step: int, total_steps: int, warmup_frac: float = 0.2, final_frac: float = 0.1) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up over warmup_frac of the run, then a cosine
    decay that ends at final_frac of the peak on the last step."""
    warmup = int(round(warmup_frac * total_steps))
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    decay_steps = max(total_steps - warmup - 1, 1)
    progress = min(max(step - warmup, 0) / decay_steps, 1.0)
    return final_frac + (1.0 - final_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _ndim(p: torch.nn.Parameter) -> int:
    # Under DeepSpeed ZeRO-3 a parameter's data is an empty placeholder; its real shape is ds_shape.
    shape = getattr(p, "ds_shape", None)
    return len(shape) if shape is not None else p.ndim


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay only where it means something (matrices); norms and biases are
    excluded, as is usual. Empty groups are left out."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if _ndim(p) >= 2]
    no_decay = [p for p in params if _ndim(p) < 2]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_adamw(params, lr: float, weight_decay: float, betas, eps: float, fused: bool = False):
    """torch AdamW over `params` (parameters, grouped by param_groups(), or ready-made groups); ``fused``: the
    fused kernel (one launch; it can skip a step flagged by ``optimizer.found_inf`` on the device)."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else param_groups(params, weight_decay)
    # foreach=None: torch's default, the multi-tensor kernels for CUDA parameters (a handful of launches instead of
    # ~10 per tensor) and the per-tensor loop on CPU (the same arithmetic as before there)
    if fused:
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, foreach=None)


def build_scheduler(optimizer, total_steps: int, warmup_frac: float, final_frac: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_lr_factor(s, total_steps, warmup_frac, final_frac)
    )
