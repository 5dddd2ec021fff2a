"""Plain-torch engine: AdamW + schedule over parameters that are either sharded (each rank owns its own
shard, e.g. the translator's C columns) or replicated (gradients averaged over ranks, DDP-style)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Literal

import torch
from s2t2_dist.distributed import collectives as coll
from s2t2_dist.engines.base import Engine, EngineKind
from s2t2_dist.models.hf import build_causal_lm, enable_activation_checkpointing
import s2t2_dist.train.phases as phases


class TorchEngine(Engine):
    """`optimizer` and `scheduler` are built over the module's trainable parameters (OptimConfig.build, .schedule;
    `TorchEngine.build` does both)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, *,
                 grad_clip: float | None, params: Literal["sharded", "replicated"] = "replicated"):
        self.module = self.model = module
        self.params_kind = params
        self.trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("TorchEngine: the module has no trainable parameters")
        self.optimizer, self.scheduler = optimizer, scheduler
        self.grad_clip = grad_clip
        self.rank, self.world = coll.rank_world()
        if params == "replicated" and self.world > 1:
            # Replicas must start identical; rank 0's values win.
            for _, p in self.trainable:
                coll.broadcast_(p.data, 0)

    @classmethod
    def build(cls, module: torch.nn.Module, optim_cfg, total_steps: int, *,
              params: Literal["sharded", "replicated"] = "replicated", lr: float | None = None) -> TorchEngine:
        """The engine with optim_cfg's optimiser and schedule over total_steps (`lr`: instead of optim_cfg.lr)."""
        if lr is not None:
            optim_cfg = dataclasses.replace(optim_cfg, lr=lr)
        # fused: the kernel skips a non-finite step on the device (step_async), no host read
        opt = optim_cfg.build([p for p in module.parameters() if p.requires_grad], fused=True)
        return cls(module, opt, optim_cfg.schedule(opt, total_steps), grad_clip=optim_cfg.grad_clip, params=params)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _grads(self):
        return [p.grad for _, p in self.trainable if p.grad is not None]

    def step(self) -> tuple[float, bool]:
        norm, applied = self.step_async()
        return float(norm), bool(applied)

    def step_async(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` without a host sync: (grad norm, applied) as device tensors. A non-finite gradient (NaN or
        inf anywhere, on any rank: the reduced squared norm is then non-finite on every rank) skips the update
        inside the fused AdamW kernel (``found_inf``: parameters, moments and step count unchanged), the clipping is
        a multiply by ``min(1, clip / norm)``: no branch reads a value back (DeepSpeed and FSDP read the norm)."""
        grads = self._grads()
        if self.params_kind == "replicated" and self.world > 1:
            average_in_buckets(grads, self.world)
        # The squared norm is summed where the gradients live (a CUDA scalar cannot be added into a CPU tensor):
        # one norm per tensor by the multi-tensor kernel (no float64 copy of every gradient), their squares added
        # in float64 so sharded partial sums add up exactly enough.
        device = grads[0].device if grads else torch.device("cpu")
        local_sq = torch.zeros((), dtype=torch.float64, device=device)
        if grads:
            local_sq = torch.stack(torch._foreach_norm([g.detach() for g in grads])).double().pow(2).sum()
        if self.params_kind == "sharded" and self.world > 1:
            coll.all_reduce_(local_sq)
        norm = local_sq.sqrt()
        finite = torch.isfinite(norm)
        if grads and self.grad_clip and self.grad_clip > 0:
            coef = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        if all(g.get("fused") for g in self.optimizer.param_groups):
            self.optimizer.found_inf = (~finite).to(device=device, dtype=torch.float32)
            self.optimizer.step()
        elif bool(finite):  # an optimiser without found_inf: the decision is read on the host
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # A skipped step still advances the schedule, so it costs its lr slot, as in the uninterrupted run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        return norm, finite

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _file(self, directory: Path) -> Path:
        return Path(directory) / f"engine_rank{self.rank:05d}.pt"

    def _layout(self) -> dict[str, list[int]]:
        """name -> [dim, start, end, total] of each parameter sharded over the ranks (from the module's
        `shard_layout()`, e.g. the translator's columns of C); empty when the module says nothing."""
        fn = getattr(self.module, "shard_layout", None)
        if self.params_kind != "sharded" or fn is None:
            return {}
        return {n: [int(x) for x in v] for n, v in fn().items()}

    def save(self, directory: Path) -> None:
        state = {
            "world_size": self.world,
            "params": {n: p.detach().cpu() for n, p in self.trainable},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "layout": self._layout(),
        }
        torch.save(state, self._file(directory))

    def load(self, directory: Path) -> None:
        f = self._file(directory)
        if not f.is_file() and (Path(directory) / "engine_rank00000.pt").is_file():
            f = Path(directory) / "engine_rank00000.pt"  # fewer ranks wrote it: rank 0's file says how many
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: no engine state for rank {self.rank} ({f.name})")
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises several types for damaged or unsafe files
            raise RuntimeError(f"checkpoint {directory}: {f.name} is unreadable ({type(e).__name__}: {e})") from e
        if state["world_size"] != self.world and self.params_kind == "sharded":
            if not self._layout() or not state.get("layout"):
                raise RuntimeError(
                    f"checkpoint {directory} was written by {state['world_size']} ranks, this run has {self.world}"
                )
            state = reshard(directory, state["world_size"], self._layout(), self.trainable)
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


#: elements per all-reduce bucket of replicated gradients (64 Mi: 256 MB of float32, DDP-sized buckets: few
#: collectives, a bounded extra buffer)
BUCKET_NUMEL = 1 << 26


def average_in_buckets(grads: list[torch.Tensor], world: int, bucket_numel: int = BUCKET_NUMEL) -> None:
    """Average replicated gradients over the ranks in place with one all-reduce per bucket of consecutive
    gradients of one dtype (one collective per tensor cost a launch and a latency each: ~100 per step for a
    transformer)."""
    i = 0
    while i < len(grads):
        j, n = i, 0
        while j < len(grads) and grads[j].dtype == grads[i].dtype and (j == i or n + grads[j].numel() <= bucket_numel):
            n += grads[j].numel()
            j += 1
        bucket = grads[i:j]
        if len(bucket) == 1:
            coll.all_reduce_(bucket[0]).div_(world)
        else:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            coll.all_reduce_(flat).div_(world)
            torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in bucket]),
                                                                          bucket)])
        i = j


def _read(directory: Path, rank: int) -> dict:
    f = Path(directory) / f"engine_rank{rank:05d}.pt"
    if not f.is_file():
        raise FileNotFoundError(f"checkpoint {directory}: no engine state for rank {rank} ({f.name})")
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a damaged file; re-raised with its name
        raise RuntimeError(f"checkpoint {directory}: {f.name} is unreadable ({type(e).__name__}: {e})") from e


def reshard(directory: Path, old_world: int, layout: dict[str, list[int]], trainable) -> dict:
    """This rank's engine state under `layout`, from the files of a checkpoint written by `old_world` ranks: each
    sharded parameter, and every optimiser tensor of its shape (Adam's moments), is reassembled from the saved
    ranges [start, end) along its dim and cut to this rank's range, so the columns move exactly; everything else
    (the step counts, the schedule, the parameter groups) is the same on every rank and taken from rank 0."""
    states = [_read(directory, r) for r in range(old_world)]
    names = [n for n, _ in trainable]
    out = {"world_size": old_world, "params": {}, "scheduler": states[0]["scheduler"],
           "optimizer": {"param_groups": states[0]["optimizer"]["param_groups"], "state": {}}, "layout": layout}
    for i, n in enumerate(names):
        spec = layout.get(n)
        if spec is None:  # replicated: rank 0's copy
            out["params"][n] = states[0]["params"][n]
            if i in states[0]["optimizer"]["state"]:
                out["optimizer"]["state"][i] = states[0]["optimizer"]["state"][i]
            continue
        dim, start, end, total = spec
        pieces = []
        for r, st in enumerate(states):
            saved = (st.get("layout") or {}).get(n)
            if saved is None or saved[0] != dim or saved[3] != total:
                raise RuntimeError(f"checkpoint {directory}: rank {r} saved {n} as {saved}, this run shards it as "
                                   f"dim {dim} of {total}")
            pieces.append((saved[1], saved[2], r))
        pieces.sort()
        if [a for a, _, _ in pieces] != [0] + [b for _, b, _ in pieces[:-1]] or pieces[-1][1] != total:
            raise RuntimeError(f"checkpoint {directory}: the saved ranges of {n} {[(a, b) for a, b, _ in pieces]} do "
                               f"not cover [0, {total}) once")

        def cut(get):
            full = torch.cat([get(states[r]) for _, _, r in pieces], dim=dim)
            return full.narrow(dim, start, end - start).clone()

        out["params"][n] = cut(lambda st: st["params"][n])
        local_shape = [st["params"][n].shape for st in states]
        opt0 = states[0]["optimizer"]["state"].get(i)
        if opt0 is None:
            continue
        new_state = {}
        for k, v in opt0.items():
            if isinstance(v, torch.Tensor) and v.dim() == len(local_shape[0]) and v.shape == local_shape[0]:
                new_state[k] = cut(lambda st, k=k: st["optimizer"]["state"][i][k])
            else:  # the step count: the same on every rank
                new_state[k] = v
        out["optimizer"]["state"][i] = new_state
    return out


class Plain(EngineKind):
    """engine.kind=plain: a replica of the model on every rank's device, in the stage's dtype; the task autocasts
    to bf16 when the run computes in bf16 (on CPU too, so CI exercises that path)."""

    def autocast(self, dtype: torch.dtype) -> torch.dtype | None:
        return torch.bfloat16 if dtype == torch.bfloat16 else None

    def build(self, cfg, source, optim_cfg, train_cfg, *, device, dtype=None, trust_remote_code=False):
        with phases.phase("model load"):
            model = build_causal_lm(source, dtype=dtype, device=device, seed=train_cfg.seed,
                                    trust_remote_code=trust_remote_code)
        from s2t2_dist.engines.model_setup import checkpointing_for, compile_blocks

        if checkpointing_for(cfg, model, train_cfg, sharded=False):
            enable_activation_checkpointing(model)
        if cfg.compile:
            compile_blocks(model)  # compiled lazily: the first step's phase holds the compile
        with phases.phase("optimiser"):
            return model, TorchEngine.build(model, optim_cfg, train_cfg.steps)
