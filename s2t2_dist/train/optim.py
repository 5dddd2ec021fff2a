"""Stage optimisers and the schedule of the paper: AdamW (0.9, 0.95, eps 1e-5), cosine with linear warm-up to a
floor. `OptimConfig.build(params)` (train/config.py) builds the optimiser named by `optim.name` from OPTIMIZERS;
a new optimiser is one class here, registered under its name:

    @register("lion")
    def lion(groups, cfg, fused=False): return Lion(groups, lr=cfg.lr, ...)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from s2t2_dist.registry import Registry

#: optim.name -> fn(parameter groups, OptimConfig, fused) -> torch.optim.Optimizer; `fused`: the engine asks for a
#: fused kernel that skips a step flagged by `optimizer.found_inf` on the device (an optimiser without one ignores
#: it: TorchEngine then reads the finite check on the host)
OPTIMIZERS: Registry = Registry("optimiser")
register = OPTIMIZERS.register


@register("adamw")
def adamw(groups: list[dict], cfg, fused: bool = False) -> torch.optim.Optimizer:
    if fused:  # one launch; it can skip a step flagged by ``optimizer.found_inf`` on the device
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    # foreach=None: torch's default, the multi-tensor kernels for CUDA parameters (a handful of launches instead of
    # ~10 per tensor) and the per-tensor loop on CPU (the same arithmetic as before there)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=None)


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
    """Parameter groups: weight decay only where it means something (matrices); norms and biases are excluded, as
    is usual. Empty groups are left out; ready-made groups (dicts) are returned as they are."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return params
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if _ndim(p) >= 2]
    no_decay = [p for p in params if _ndim(p) < 2]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_scheduler(optimizer, total_steps: int, warmup_frac: float, final_frac: float):
    """LambdaLR over cosine_lr_factor."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(cosine_lr_factor, total_steps=total_steps, warmup_frac=warmup_frac,
                                     final_frac=final_frac)
    )
