"""The interface the shared training loop drives. Each engine owns the model's parameters, the optimiser, the
lr schedule, gradient reduction and its own checkpoint format; the loop owns everything else (data position,
RNG, step counter, bad-step accounting) and passes it as `client_state`."""

from __future__ import annotations

import abc
from pathlib import Path

import torch


class Engine(abc.ABC):
    #: the module whose forward the task calls (may be a wrapper such as a DeepSpeedEngine)
    module: torch.nn.Module

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss (already divided by the accumulation steps)."""

    @abc.abstractmethod
    def step(self) -> tuple[float, bool]:
        """Clip, check and apply the accumulated gradients; advance the lr schedule.

        Returns (global grad norm before clipping, applied). A step whose gradients are not finite on any rank is
        not applied on any rank (applied=False) and the gradients are dropped."""

    @abc.abstractmethod
    def lr(self) -> float: ...

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write this rank's share of params + optimiser + scheduler into `directory` (collective)."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what save() wrote (collective). Errors name the directory and what does not match."""

    @property
    def device(self) -> torch.device:
        """Where batches must go before `self.module(...)`."""
        for p in self.module.parameters():
            return p.device
        return torch.device("cpu")

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()
