"""Plain-torch engine: AdamW + schedule over parameters that are either sharded (each rank owns its own
shard, e.g. the translator's C columns) or replicated (gradients averaged over ranks, DDP-style)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Literal

import torch
from s2t2_dist.dist import collectives as coll
from s2t2_dist.engines.base import Engine
from s2t2_dist.train.optim import build_adamw, build_scheduler


class TorchEngine(Engine):
    def __init__(
        self,
        module: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas,
        eps: float,
        total_steps: int,
        warmup_frac: float,
        final_frac: float,
        grad_clip: float | None,
        params: Literal["sharded", "replicated"] = "replicated",
    ):
        self.module = module
        self.params_kind = params
        self.trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("TorchEngine: the module has no trainable parameters")
        self.optimizer = build_adamw([p for _, p in self.trainable], lr, weight_decay, betas, eps)
        self.scheduler = build_scheduler(self.optimizer, total_steps, warmup_frac, final_frac)
        self.grad_clip = grad_clip
        self.rank, self.world = coll.rank_world()
        if params == "replicated" and self.world > 1:
            # Replicas must start identical; rank 0's values win.
            for _, p in self.trainable:
                coll.broadcast_(p.data, 0)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _grads(self):
        return [p.grad for _, p in self.trainable if p.grad is not None]

    def step(self) -> tuple[float, bool]:
        grads = self._grads()
        if self.params_kind == "replicated" and self.world > 1:
            for g in grads:
                coll.all_reduce_(g)
                g.div_(self.world)
        # The squared norm is summed where the gradients live (a CUDA scalar cannot be added into a CPU tensor):
        # one norm per tensor by the multi-tensor kernel (no float64 copy of every gradient), their squares added
        # in float64 so sharded partial sums add up exactly enough.
        device = grads[0].device if grads else torch.device("cpu")
        local_sq = torch.zeros((), dtype=torch.float64, device=device)
        if grads:
            local_sq = torch.stack(torch._foreach_norm([g.detach() for g in grads])).double().pow(2).sum()
        if self.params_kind == "sharded" and self.world > 1:
            coll.all_reduce_(local_sq)
        # A NaN anywhere makes the squared norm NaN on every rank after the reduction (of the gradients when
        # replicated, of the norm when sharded), so all ranks agree. The one host sync of the step: the decision
        # to apply it (DeepSpeed and FSDP make the same one).
        sq = float(local_sq)
        finite = math.isfinite(sq)
        norm = math.sqrt(sq) if finite else sq
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            # The schedule still advances so a skipped step costs its lr slot, as in the uninterrupted run.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            return norm, False
        if self.grad_clip and self.grad_clip > 0 and norm > self.grad_clip:
            torch._foreach_mul_(grads, self.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm, True

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _file(self, directory: Path) -> Path:
        return Path(directory) / f"engine_rank{self.rank:05d}.pt"

    def save(self, directory: Path) -> None:
        state = {
            "world_size": self.world,
            "params": {n: p.detach().cpu() for n, p in self.trainable},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        torch.save(state, self._file(directory))

    def load(self, directory: Path) -> None:
        f = self._file(directory)
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: no engine state for rank {self.rank} ({f.name})")
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises several types for damaged or unsafe files
            raise RuntimeError(f"checkpoint {directory}: {f.name} is unreadable ({type(e).__name__}: {e})") from e
        if state["world_size"] != self.world:
            raise RuntimeError(
                f"checkpoint {directory} was written by {state['world_size']} ranks, this run has {self.world}"
            )
        names = {n for n, _ in self.trainable}
        if set(state["params"]) != names:
            raise RuntimeError(
                f"checkpoint {directory}: parameters {sorted(state['params'])} do not match this model's {sorted(names)}"
            )
        with torch.no_grad():
            for n, p in self.trainable:
                src = state["params"][n]
                if src.shape != p.shape:
                    raise RuntimeError(f"checkpoint {directory}: {n} has shape {tuple(src.shape)}, expected {tuple(p.shape)}")
                p.copy_(src)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
