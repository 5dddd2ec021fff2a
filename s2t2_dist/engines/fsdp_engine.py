"""FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the Engine interface.

Each transformer block is its own FSDP unit, then the root (embeddings, final norm, LM head, tied or not). The
optimiser and schedule are the paper's (train.optim); gradients are clipped with `clip_grad_norm_` on the sharded
DTensor gradients (the norm is global); a step whose global norm is not finite is skipped on every rank. Checkpoints
are torch.distributed.checkpoint (DCP) directories of the sharded model + optimiser state; resume is bit-identical on
CPU float32. bf16 mixed precision (bf16 compute, float32 master weights and gradient reduction) on GPU only.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from s2t2_dist.distributed import collectives as coll
from s2t2_dist.engines.base import Engine, EngineKind
from s2t2_dist.models.hf import build_causal_lm, enable_activation_checkpointing

try:  # torch >= 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - torch 2.4/2.5
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

FSDP_DIR = "fsdp"


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the classes a transformers model lists in `_no_split_modules`
    (e.g. OlmoDecoderLayer), else the children of a ModuleList called layers / h / blocks."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return list(m)
    raise ValueError(f"FSDP2Engine: cannot find the transformer blocks of {type(model).__name__}")


def local_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model)."""
    local = total = 0
    for p in model.parameters():
        if hasattr(p, "to_local"):
            local += p.to_local().numel()
        else:
            local += p.numel()
        total += p.numel()
    return local, total


def check_dcp_metadata(path: Path) -> None:
    """torch.distributed.checkpoint reads `.metadata` with plain pickle.load, which could run code from a crafted
    checkpoint: unpickle it first allowing only what DCP writes there (its metadata dataclasses, torch sizes,
    dtypes and layouts, paths). Raises RuntimeError naming the file and the refused global."""
    import pickle

    def allowed(module: str, name: str) -> bool:
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                      "torch.distributed.checkpoint.planner"):
            return not name.startswith("__")
        if module == "torch":
            return name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                                torch.memory_format))
        return (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                                  ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                                  ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}

    class _Checked(pickle.Unpickler):
        def find_class(self, module, name):
            if not allowed(module, name):
                raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
            return super().find_class(module, name)

    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path.parent}: {path.name} is missing")
    try:
        with open(path, "rb") as f:
            _Checked(f).load()
    except Exception as e:  # noqa: BLE001 - any failure means we do not hand the file to pickle.load
        raise RuntimeError(f"checkpoint file {path} is not plain DCP metadata ({type(e).__name__}: {e}); refusing "
                           "to unpickle it (no code runs from a checkpoint)") from None


class FSDP2Engine(Engine):
    """Over a model sharded by `shard` and an optimiser built over its (DTensor) parameters; `FSDP2Engine.build`
    does both."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, *, grad_clip: float,
                 mixed_precision: bool):
        self.rank, self.world = coll.rank_world()
        gpu = torch.cuda.is_available()
        self._device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        self.model = self.module = model
        self.mixed_precision = mixed_precision
        self.optimizer, self.scheduler = optimizer, scheduler
        self.grad_clip = grad_clip

    @staticmethod
    def shard(model: torch.nn.Module, *, precision: str = "auto", offload: bool = False,
              reshard_after_forward: bool = True, mixed_precision: bool | None = None) -> bool:
        """fully_shard each transformer block, then the root, over all ranks; returns whether bf16 mixed precision
        (bf16 compute, float32 master weights and gradient reduction: on GPU only) is on."""
        if not coll.initialized():
            raise RuntimeError("FSDP2Engine needs torch.distributed initialised (run under torchrun)")
        from torch.distributed.device_mesh import init_device_mesh

        gpu = torch.cuda.is_available()
        mesh = init_device_mesh("cuda" if gpu else "cpu", (coll.world_size(),))
        if mixed_precision is None:
            mixed_precision = gpu and precision in ("bf16", "auto")
        if mixed_precision and not gpu:
            warnings.warn("FSDP2Engine: bf16 mixed precision needs a GPU; running in float32", stacklevel=2)
            mixed_precision = False
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
              else MixedPrecisionPolicy())
        kw = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
        if offload:
            if gpu:
                kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            else:
                warnings.warn("FSDP2Engine: offload ignored without a GPU (everything is on CPU already)", stacklevel=2)
        for block in transformer_blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return mixed_precision

    @classmethod
    def build(cls, model: torch.nn.Module, optim_cfg, train_cfg, *, activation_checkpointing: bool = False,
              offload: bool = False, reshard_after_forward: bool = True,
              mixed_precision: bool | None = None) -> "FSDP2Engine":
        """Shard `model`, then build optim_cfg's optimiser over the shards and the schedule over train_cfg.steps."""
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        mp = cls.shard(model, precision=train_cfg.precision, offload=offload,
                       reshard_after_forward=reshard_after_forward, mixed_precision=mixed_precision)
        opt = optim_cfg.build([p for p in model.parameters() if p.requires_grad])
        return cls(model, opt, optim_cfg.schedule(opt, train_cfg.steps), grad_clip=optim_cfg.grad_clip,
                   mixed_precision=mp)

    def backward(self, loss: torch.Tensor) -> None:
        # Gradients are reduce-scattered after every micro-batch and accumulate sharded (memory-light).
        loss.backward()

    def step(self) -> tuple[float, bool]:
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False,
                                               foreach=None if self._device.type == "cuda" else False)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()  # reduce the per-shard partial norms: the same value on every rank
        norm = float(total)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            return norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm, True

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def device(self) -> torch.device:
        return self._device

    # ---- checkpoints (DCP)
    def _sched_file(self, directory: Path) -> Path:
        return Path(directory) / f"fsdp_sched_rank{self.rank:05d}.pt"

    def save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(directory) / FSDP_DIR))
        torch.save({"world_size": self.world, "scheduler": self.scheduler.state_dict()}, self._sched_file(directory))

    def load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        d = Path(directory) / FSDP_DIR
        f = self._sched_file(directory)
        if not f.is_file():  # written by fewer ranks: the schedule is the same on every rank
            f = Path(directory) / "fsdp_sched_rank00000.pt"
        if not d.is_dir() or not f.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: no FSDP2 state ({FSDP_DIR}/ or {f.name} is missing)")
        extra = torch.load(f, map_location="cpu", weights_only=True)
        # Another number of ranks is fine: DCP reads each saved shard into whatever parameter (and Adam moment)
        # shards this run's mesh has (the checkpointer decides whether that is allowed: elastic)
        check_dcp_metadata(d / ".metadata")
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=str(d))
        except Exception as e:
            raise RuntimeError(f"checkpoint {directory}: the FSDP2 state does not match this model/optimiser: {e}") from e
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(extra["scheduler"])

    # ---- export
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full float32 state dict on rank 0 (CPU), empty on the others. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class FSDP2(EngineKind):
    """engine.kind=fsdp: a 1-rank group when there is no launcher (FSDP2 needs one); the model loaded whole in
    float32 on every rank, then sharded."""

    def init_distributed(self) -> None:
        from s2t2_dist.distributed.env import init_distributed

        init_distributed(single_rank_group=True)

    def build(self, cfg, source, optim_cfg, train_cfg, *, device, dtype=None, trust_remote_code=False):
        # float32 master weights whatever `dtype`: bf16 compute is the mixed-precision policy's
        model = build_causal_lm(source, seed=train_cfg.seed, trust_remote_code=trust_remote_code)
        return model, FSDP2Engine.build(model, optim_cfg, train_cfg,
                                        activation_checkpointing=cfg.activation_checkpointing, offload=cfg.offload,
                                        reshard_after_forward=cfg.fsdp_reshard_after_forward)
