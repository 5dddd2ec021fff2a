"""Plain-torch engine: AdamW + schedule over parameters that are either sharded (each rank owns its own
shard, e.g. the translator's C columns) or replicated (gradients averaged over ranks, DDP-style)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from s2t2_dist.engines.base import Engine
from s2t2_dist.train.optim import build_adamw, build_scheduler, cosine_lr_factor


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
        self._warmup_frac, self._final_frac = warmup_frac, final_frac
        self.grad_clip = grad_clip
        self.rank, self.world = _world()
        if params == "replicated" and self.world > 1:
            # Replicas must start identical; rank 0's values win.
            for _, p in self.trainable:
                dist.broadcast(p.data, 0)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _grads(self):
        return [p.grad for _, p in self.trainable if p.grad is not None]

    def step(self) -> tuple[float, bool]:
        grads = self._grads()
        if self.params_kind == "replicated" and self.world > 1:
            for g in grads:
                dist.all_reduce(g)
                g.div_(self.world)
        local_sq = torch.zeros((), dtype=torch.float64)
        for g in grads:
            local_sq += g.detach().double().pow(2).sum()
        if self.params_kind == "sharded" and self.world > 1:
            dist.all_reduce(local_sq)
        # A NaN anywhere makes the squared norm NaN on every rank after the reduction, so all ranks agree.
        if self.params_kind == "replicated" and self.world > 1:
            flag = torch.tensor([0.0 if torch.isfinite(local_sq) else 1.0])
            dist.all_reduce(flag)
            finite = flag.item() == 0.0
        else:
            finite = bool(torch.isfinite(local_sq))
        norm = float(local_sq.sqrt())
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            # The schedule still advances so a skipped step costs its lr slot, as in the uninterrupted run.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            return norm, False
        if self.grad_clip and self.grad_clip > 0 and norm > self.grad_clip:
            scale = self.grad_clip / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm, True

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_phase(self, lr: float, start: int, end: int, reset_state: bool) -> None:
        """Train steps [start, end) on a schedule of their own (warm-up, cosine, floor as configured) with peak
        ``lr``, optionally from a fresh AdamW state: e.g. the translator's dense warm-up, then its sparse plan
        (the moments of the old objective's gradients would be wrong in scale). Idempotent; call it again after a
        resume (the schedule function is not part of the saved state; lr and moments are)."""
        if reset_state:
            self.optimizer.state.clear()
        n = max(end - start, 1)
        wf, ff = self._warmup_frac, self._final_frac
        fn = lambda s: cosine_lr_factor(s - start, n, wf, ff)  # noqa: E731
        self.scheduler.lr_lambdas = [fn for _ in self.scheduler.lr_lambdas]
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        for g in self.optimizer.param_groups:
            g["lr"] = lr * fn(self.scheduler.last_epoch)

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
