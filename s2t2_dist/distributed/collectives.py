"""Every collective this package makes, in one place, each on the process group that serves its tensors' device.

A process group maps device types to backends. On a GPU node NCCL serves CUDA tensors only: a collective on a CPU
tensor there raises "No backend type associated with device type cpu". So:

- bookkeeping (sums of Python scalars, "did any rank fail", barriers, object gathers) always runs on CPU tensors
  over :func:`host_group`: the default group when it has a CPU backend (``init_distributed`` creates it as
  ``cpu:gloo,cuda:nccl`` on GPUs, ``gloo`` on CPUs), otherwise a separate gloo group over the same ranks, created
  once (as OLMo-core keeps a gloo group beside NCCL);
- tensor collectives (gradients, the sharded Sinkhorn, P statistics) take the tensor where it lives and use
  :func:`group_for` its device, so a CUDA tensor goes to NCCL and a CPU tensor to gloo.

Tests start the default group as ``cuda:gloo`` (no CPU backend, like NCCL alone): a CPU collective that bypasses
this module then fails on CPU exactly as it would on a GPU node. tests/distributed/test_collectives.py also greps the
package so that no module outside ``s2t2_dist/distributed/`` calls a ``torch.distributed`` collective itself.
"""

from __future__ import annotations

import datetime
from typing import Any
from collections.abc import Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# (id of the default group it belongs to, the gloo group); rebuilt when the default group changes
_host: tuple[int, Any] | None = None


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def rank_world() -> tuple[int, int]:
    return rank(), world_size()


def distributed() -> bool:
    """More than one rank (a 1-rank process group needs no collectives)."""
    return world_size() > 1


def _has_backend(device_type: str, group=None) -> bool:
    cfg = dist.get_backend_config(group)  # e.g. "cpu:gloo,cuda:nccl", "cuda:nccl"
    return any(part.split(":")[0] == device_type for part in cfg.split(","))


def host_group(timeout_s: float | None = None):
    """The group for CPU bookkeeping collectives: the default one if it serves CPU tensors, else a gloo group over
    all ranks (creating it is itself collective: ``init_distributed`` does it eagerly on every rank)."""
    global _host
    if not initialized():
        return None
    world = dist.group.WORLD
    if _has_backend("cpu"):
        return world
    if _host is None or _host[0] != id(world):
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        _host = (id(world), dist.new_group(backend="gloo", **kw))
    return _host[1]


def forget_groups() -> None:
    """Drop cached groups (called when the default group is destroyed)."""
    global _host
    _host = None


def group_for(device: torch.device | str):
    """The process group that serves tensors on `device` (``dist.group.WORLD`` when the default one does; None when
    torch.distributed is not initialised)."""
    device = torch.device(device)
    if not initialized():
        return None
    if device.type == "cpu":
        return host_group()
    if not _has_backend(device.type):
        raise RuntimeError(f"the default process group ({dist.get_backend_config()}) has no backend for "
                           f"{device.type} tensors")
    return dist.group.WORLD


# ---------------------------------------------------------------------------------------------------------------
# bookkeeping: Python values in, Python values out, CPU tensors over the host group


def barrier() -> None:
    if distributed():
        dist.barrier(group=host_group())


def sum_scalars(values: Sequence[float]) -> list[float]:
    """Elementwise sums over ranks, exact for integers below 2**53 (float64 on the host group)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if distributed():
        dist.all_reduce(t, group=host_group())
    return t.tolist()


def max_scalars(values: Sequence[float]) -> list[float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank iff `flag` is True on at least one rank."""
    return sum_scalars([1.0 if flag else 0.0])[0] > 0


def all_ranks(ok: bool) -> bool:
    """True on every rank iff `ok` is True on every rank (a failure on one rank is seen by all)."""
    return not any_rank(not ok)


def raise_if_any_failed(err: BaseException | None, what: str) -> None:
    """Re-raise `err` on its rank and a matching error on every other rank (so no rank waits forever)."""
    if any_rank(err is not None):
        if err is not None and (not isinstance(err, Exception) or type(err).__name__ == "WriteError"):
            raise err  # Ctrl-C, a stop signal, a full disk: said as what they are, not as "failed: "
        if err is not None:
            raise RuntimeError(f"{what} failed: {err}") from err
        raise RuntimeError(f"{what} failed on another rank")


def all_gather_object(obj: Any) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    if not distributed():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj, group=host_group())
    return out


# ---------------------------------------------------------------------------------------------------------------
# tensors where they live


def all_reduce_(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place all-reduce of `t` over `group` (default: every rank, on the group serving t's device)."""
    if group is None and not distributed():
        return t
    if group is None:
        group = group_for(t.device)
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    if distributed():
        dist.broadcast(t, src, group=group_for(t.device))
    return t
