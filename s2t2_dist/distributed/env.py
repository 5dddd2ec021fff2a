"""Rank / world discovery for every way this package is launched, in one place.

Launchers publish the same facts under different names:
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; the deepspeed
  launcher: the same but LOCAL_SIZE, CROSS_RANK, CROSS_SIZE for the node layout;
- srun (one task per GPU): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES, and the
  rendezvous must be derived (first host of the allocation, a port from the job id);
- submitit runs its tasks through srun, so it is the srun case (its JobEnvironment reads the same variables).
torchrun-style variables win when both are present (torchrun started under srun sets its own).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch

from s2t2_dist import envvars
from s2t2_dist.distributed.rendezvous import slurm_first_host_addr, slurm_port


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(env: dict, key: str, default: int | None = None) -> int:
    val = env.get(key)
    if val is None or val == "":
        if default is None:
            raise RuntimeError(f"environment variable {key} is required by this launcher but is not set")
        return default
    try:
        return int(val)
    except ValueError:
        raise RuntimeError(f"environment variable {key}={val!r} is not an integer") from None


def detect(env: dict | None = None) -> DistEnv:
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        # torchrun: LOCAL_WORLD_SIZE, GROUP_RANK; the deepspeed launcher: LOCAL_SIZE, CROSS_RANK, CROSS_SIZE
        local_world = _int(env, "LOCAL_WORLD_SIZE", _int(env, "LOCAL_SIZE", world))
        rank = _int(env, "RANK")
        node_rank = _int(env, "GROUP_RANK", _int(env, "CROSS_RANK", rank // max(local_world, 1)))
        return DistEnv(
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=local_world,
            node_rank=node_rank,
            num_nodes=_int(env, "CROSS_SIZE", max(world // max(local_world, 1), 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            launcher="deepspeed" if "CROSS_RANK" in env else "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and env.get("SLURM_STEP_ID") is not None:
        world = _int(env, "SLURM_NTASKS")
        nnodes = _int(env, "SLURM_NNODES", 1)
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local_world = int(per_node) if per_node.isdigit() else max(world // nnodes, 1)
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=local_world,
            node_rank=_int(env, "SLURM_NODEID", 0),
            num_nodes=nnodes,
            # The batch script (slurm/common.sh) or submit.py exports MASTER_ADDR once for the whole job; asking
            # scontrol from every rank of a large job would flood slurmctld.
            master_addr=envvars.get("S2T2_MASTER_ADDR", env) or env.get("MASTER_ADDR") or slurm_first_host_addr(env),
            master_port=slurm_port(env),
            launcher="slurm",
        )
    return DistEnv()


def use_cuda() -> bool:
    """GPUs are used when present, unless S2T2_DEVICE=cpu (tests, or CPU-only runs on a GPU node)."""
    return torch.cuda.is_available() and envvars.get("S2T2_DEVICE") != "cpu"


def default_backend() -> str:
    """NCCL for CUDA tensors beside gloo for CPU ones (bookkeeping collectives run on CPU tensors; NCCL alone would
    reject them). S2T2_DIST_BACKEND overrides it: the tests set ``cuda:gloo``, a group with no CPU backend, so that
    a CPU collective that does not go through s2t2_dist.distributed.collectives fails on CPU as it would under NCCL."""
    override = envvars.get("S2T2_DIST_BACKEND")
    if override:
        return override
    return "cpu:gloo,cuda:nccl" if use_cuda() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0, single_rank_group: bool = False
                     ) -> DistEnv:
    """Initialise torch.distributed from whatever launcher started us; a no-op for a single process unless
    `single_rank_group` (FSDP2 needs a process group even on one GPU: a 1-rank group on a free local port)."""
    import torch.distributed as dist

    denv = detect()
    if use_cuda():
        torch.cuda.set_device(denv.local_rank % torch.cuda.device_count())
    if dist.is_initialized():
        return denv
    # Under a launcher (torchrun, deepspeed) even one rank joins through its environment: torchrun makes rank 0 a
    # client of its agent's store (TORCHELASTIC_USE_AGENT_STORE), so a group on a fresh port waits for a server
    # that never comes, until the timeout (FSDP2 under `torchrun --nproc_per_node 1` hung so)
    launched = denv.launcher in ("torchrun", "deepspeed") and "MASTER_PORT" in os.environ
    if denv.world_size == 1 and not (single_rank_group and launched):
        if single_rank_group:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend=backend or default_backend(), init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s))
        return denv
    os.environ.setdefault("MASTER_ADDR", denv.master_addr)
    os.environ.setdefault("MASTER_PORT", str(denv.master_port))
    os.environ.setdefault("RANK", str(denv.rank))
    os.environ.setdefault("WORLD_SIZE", str(denv.world_size))
    os.environ.setdefault("LOCAL_RANK", str(denv.local_rank))
    dist.init_process_group(
        backend=backend or default_backend(),
        init_method=f"tcp://{denv.master_addr}:{denv.master_port}" if denv.launcher == "slurm" else "env://",
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    from s2t2_dist.distributed.collectives import host_group

    host_group(timeout_s)  # collective: created now, on every rank in the same order, if the default lacks CPU
    return denv


def device_for(denv: DistEnv) -> torch.device:
    if use_cuda():
        return torch.device("cuda", denv.local_rank % torch.cuda.device_count())
    return torch.device("cpu")
