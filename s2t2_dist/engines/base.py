"""The interface the shared training loop drives. Each engine owns the model's parameters, the optimiser, the
lr schedule, gradient reduction and its own checkpoint format; the loop owns everything else (data position,
RNG, step counter, bad-step accounting) and passes it as `client_state`."""

from __future__ import annotations

import abc
from pathlib import Path

import torch

from s2t2_dist.distributed import collectives as coll
from s2t2_dist.utils.io import write_error


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

    def step_async(self) -> tuple:
        """:meth:`step` as the loop calls it: an engine that can decide without a host read (TorchEngine) returns
        (grad norm, applied) as device tensors; here the host values of step()."""
        return self.step()

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

    # ---- export
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (CPU), empty on the others. Collective. Here: every rank holds the model."""
        if coll.rank_world()[0] != 0:
            return {}
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def export_consolidated(self, out_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Path | None:
        """A plain transformers directory (`save_pretrained`: config + safetensors) of the current weights in
        `dtype`, loadable without this engine; rank 0 writes. Collective."""
        out_dir = Path(out_dir)
        sd = self.consolidated_state_dict()
        err = None
        if coll.rank_world()[0] == 0:
            try:
                sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
                self.model.save_pretrained(str(out_dir), state_dict=sd, safe_serialization=True)
            except BaseException as e:  # noqa: BLE001 - reported on every rank below
                err = (write_error(out_dir / "model.safetensors", e) if isinstance(e, Exception) else None) or e
        coll.raise_if_any_failed(err, f"exporting {out_dir}")
        return out_dir if coll.rank_world()[0] == 0 else None


class EngineKind:
    """The decisions that depend on `engine.kind`, made before and around an Engine: how torch.distributed starts,
    how the model is loaded (sharded or a replica), the autocast the task wraps the forward in. One subclass per
    kind, in its engine's module, named in engines/build.py KINDS."""

    def init_distributed(self) -> None:
        """Start torch.distributed as this engine needs it (before the stage's setup(), which keeps the group)."""

    def autocast(self, dtype: torch.dtype) -> torch.dtype | None:
        """The autocast dtype of the task's forward for compute dtype `dtype` (None: the engine does it)."""
        return None

    def build(self, cfg, source, optim_cfg, train_cfg, *, device: torch.device, dtype: torch.dtype | None = None,
              trust_remote_code: bool = False) -> tuple[torch.nn.Module, Engine]:
        """(the transformers model, its Engine) from `source`: a model directory, a PretrainedConfig, or an
        nn.Module already built. `dtype`: the weights of a replica on `device` (None: float32); sharded engines keep
        float32 master weights and compute in bf16 themselves."""
        raise NotImplementedError
