"""FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the Engine interface.

Each transformer block is its own FSDP unit, then the root (embeddings, final norm, LM head, tied or not). From a
model directory the model is built the torchtitan way: parameters on the meta device (no memory, no init), sharded,
materialised as shards only on the rank's device, then each rank reads just its rows of every weight from the
safetensors files (no rank ever holds the whole model, no full float32 copy, no per-parameter broadcast). The
optimiser and schedule are the paper's (train.optim): the fused AdamW (on CUDA and CPU), which skips a step whose
global gradient norm is not finite on the device (``found_inf``), after a clipping that is a multiply: a step reads
nothing back to the host. Checkpoints
are torch.distributed.checkpoint (DCP) directories of the sharded model + optimiser state; resume is bit-identical on
CPU float32. bf16 mixed precision (bf16 compute, float32 master weights and gradient reduction) on GPU only.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch

from s2t2_dist.distributed import collectives as coll
from s2t2_dist.engines.base import Engine, EngineKind
from s2t2_dist.models.hf import build_causal_lm, enable_activation_checkpointing, transformer_blocks
import s2t2_dist.train.phases as phases

try:  # torch >= 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - torch 2.4/2.5
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

FSDP_DIR = "fsdp"


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
              mixed_precision: bool | None = None, weights: dict[str, Path] | None = None,
              compile: bool = False) -> FSDP2Engine:
        """Shard `model`, then build optim_cfg's optimiser over the shards and the schedule over train_cfg.steps.
        `weights` (parameter name -> safetensors file, from `safetensors_index`): `model`'s parameters are on the
        meta device and are materialised as shards and loaded from these files after sharding. In torchtitan's
        order: activation checkpointing, then the per-block compile (`compile`), then sharding (FSDP2's hooks stay
        outside the compiled forwards)."""
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        if compile:
            from s2t2_dist.engines.model_setup import compile_blocks

            compile_blocks(model)
        with phases.phase("sharding"):
            mp = cls.shard(model, precision=train_cfg.precision, offload=offload,
                           reshard_after_forward=reshard_after_forward, mixed_precision=mixed_precision)
        if weights is not None:
            with phases.phase("weights load (sharded)"):
                load_sharded(model, weights, device=shard_device(offload))
        with phases.phase("optimiser"):
            # fused: one kernel over all shards, and found_inf skips a non-finite step on the device (step_async)
            opt = optim_cfg.build([p for p in model.parameters() if p.requires_grad], fused=True)
            sched = optim_cfg.schedule(opt, train_cfg.steps)
        return cls(model, opt, sched, grad_clip=optim_cfg.grad_clip, mixed_precision=mp)

    def backward(self, loss: torch.Tensor) -> None:
        # Gradients are reduce-scattered after every micro-batch and accumulate sharded (memory-light).
        loss.backward()

    def step(self) -> tuple[float, bool]:
        norm, applied = self.step_async()
        return float(norm), bool(applied)

    def step_async(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and apply without a host read: (global grad norm, applied) as device tensors. The norm of the
        sharded gradients is reduced over the ranks (one all-reduce); clipping multiplies by min(1, clip / norm);
        a non-finite norm skips the update inside the fused AdamW (found_inf: parameters, moments and step count
        unchanged); the schedule advances either way (a skipped step costs its lr slot)."""
        grads = [p.grad for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        if not grads:
            raise RuntimeError("FSDP2Engine.step: no parameter has a gradient (was backward called?)")
        # torch's own total norm over DTensor gradients: per-shard partial norms, reduced by full_tensor()
        total = torch.nn.utils.get_total_norm(grads, foreach=True) if hasattr(torch.nn.utils, "get_total_norm") \
            else torch.nn.utils.clip_grad_norm_(grads, float("inf"), foreach=True)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        norm = total.to(torch.float32)
        finite = torch.isfinite(norm)
        if self.grad_clip and self.grad_clip > 0:
            coef = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        self.optimizer.found_inf = (~finite).to(torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        return norm, finite

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


@contextlib.contextmanager
def params_on_meta():
    """Every parameter registered inside is moved to the meta device as it is created (no memory, no init: a
    module's initialisation then runs on meta); buffers stay real (e.g. the rotary inv_freq a checkpoint does not
    hold)."""
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def safetensors_index(source) -> dict[str, Path] | None:
    """Tensor name -> file of a model directory saved as safetensors (sharded with an index, or one file); None
    for anything else (a config, a module, a .bin checkpoint, a hub id)."""
    if not isinstance(source, (str, Path)) or not Path(source).is_dir():
        return None
    d = Path(source)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return {k: d / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = d / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    return None


def empty_causal_lm(source, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model of a directory with its parameters on the meta device (float32 when materialised)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    bad = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if bad:
        raise RuntimeError(f"FSDP2: buffers {bad[:3]} were built on the meta device")
    return model


def _dim0_range(p: torch.Tensor, local: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the global rows this rank holds of a parameter sharded on dim 0 (FSDP2 cuts as torch.chunk:
    ceil(n / ranks) rows per rank, the last ones shorter or empty)."""
    n = p.shape[0] if p.dim() else 1
    placements = getattr(p, "placements", ())
    if not placements or not p.dim() or local.shape == p.shape:
        return 0, n
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    if local.shape[0] != min(chunk, n - start):
        raise RuntimeError(f"FSDP2: unexpected shard of {tuple(p.shape)}: {tuple(local.shape)} on rank {rank}")
    return start, start + local.shape[0]


def shard_device(offload: bool) -> torch.device:
    """Where a meta-built model's shards are materialised: this rank's GPU, or the CPU where there is none or
    where the shards live with CPU offload (FSDP2's CPUOffloadPolicy expects its sharded parameters on the CPU:
    its lazy init refuses them on a GPU; it moves each unsharded parameter to the GPU itself)."""
    if torch.cuda.is_available() and not offload:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def load_sharded(model: torch.nn.Module, weights: dict[str, Path], device: torch.device | None = None) -> None:
    """Materialise a meta-device model sharded by fully_shard on ``device`` (None: :func:`shard_device` without
    offload) and fill each rank's shards straight from the safetensors files (only this rank's rows are read).
    Raises naming a parameter the files lack."""
    from safetensors import safe_open

    buffers = {n: b.clone() for n, b in model.named_buffers(remove_duplicate=False)}
    model.to_empty(device=device or shard_device(False))
    # buffers (e.g. rotary frequencies) are not FSDP's: on the compute device even when the shards are offloaded
    buffer_device = shard_device(False)
    for mname, mod in model.named_modules(remove_duplicate=False):
        for bname, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[bname] = buffers[f"{mname}.{bname}" if mname else bname].to(buffer_device)
    names = dict(model.named_parameters())  # a tied parameter once, under its first name
    missing = [n for n in names if n not in weights]
    if missing:
        raise RuntimeError(f"FSDP2: the checkpoint has no tensor for {missing[:5]} (of {len(missing)})")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(weights[n], []).append(n)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for n in keys:
                p = names[n]
                local = p.to_local() if hasattr(p, "to_local") else p
                start, end = _dim0_range(p, local)
                if local.numel():
                    src = f.get_slice(n)
                    rows = src[start:end] if p.dim() else src[:]
                    local.copy_(rows.reshape(local.shape))


class FSDP2(EngineKind):
    """engine.kind=fsdp: a 1-rank group when there is no launcher (FSDP2 needs one). From a safetensors model
    directory: built on the meta device, sharded, then each rank loads its shards (torchtitan's order); from a
    config (random init) or a module: built whole in float32, then sharded."""

    def init_distributed(self) -> None:
        from s2t2_dist.distributed.env import init_distributed

        init_distributed(single_rank_group=True)

    def build(self, cfg, source, optim_cfg, train_cfg, *, device, dtype=None, trust_remote_code=False):
        # float32 master weights whatever `dtype`: bf16 compute is the mixed-precision policy's
        weights = safetensors_index(source)
        with phases.phase("model build (meta)" if weights is not None else "model load"):
            model = (empty_causal_lm(source, trust_remote_code=trust_remote_code) if weights is not None else
                     build_causal_lm(source, seed=train_cfg.seed, trust_remote_code=trust_remote_code))
        from s2t2_dist.engines.model_setup import checkpointing_for

        return model, FSDP2Engine.build(model, optim_cfg, train_cfg,
                                        activation_checkpointing=checkpointing_for(cfg, model, train_cfg, sharded=True),
                                        offload=cfg.offload, reshard_after_forward=cfg.fsdp_reshard_after_forward,
                                        weights=weights, compile=cfg.compile)
