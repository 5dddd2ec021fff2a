"""A small stand-in entry point for checking a cluster launch end to end (rendezvous, collectives, logging,
checkpoint/resume under preemption) without models or data:

    srun python -m s2t2_dist.cluster.probe --out runs/probe [--steps 6] [--step-time 0.2]
    S2T2_ENTRY="-m s2t2_dist.cluster.probe" sbatch slurm/translate_1b.sh --out runs/probe

Every rank initialises torch.distributed exactly as the real stages do (`init_distributed()`), checks an
all-reduce, then trains a tiny replicated linear model with the shared training loop (so SIGTERM/SIGUSR1 make it
checkpoint and stop, and a new attempt resumes from the latest checkpoint), logging global and per-node scalars,
a text table and a heatmap to OUT/tb with MetricsLogger. Each rank writes OUT/ranks/<attempt>_rank<NNNNN>.json with
what it saw; rank 0 writes OUT/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch

from s2t2_dist.train.loop import Task


class _Loader:
    """Deterministic batches of a linear regression problem, resumable by position."""

    def __init__(self, rank: int, micro_batch: int, dim: int, seed: int):
        self.rank, self.mb, self.dim, self.seed = rank, micro_batch, dim, seed
        self.pos = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.pos)
            x = torch.randn(self.mb, self.dim, generator=g)
            self.pos += 1
            yield {"x": x, "y": x.sum(dim=1, keepdim=True), "input_ids": torch.zeros(self.mb, 1, dtype=torch.long)}

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = int(state["pos"])


class _Task(Task):
    def __init__(self, model: torch.nn.Module, step_time: float, is_main: bool):
        self.model, self.step_time, self.is_main = model, step_time, is_main

    def loss(self, batch):
        if self.step_time:
            time.sleep(self.step_time)
        pred = self.model(batch["x"])
        loss = torch.nn.functional.mse_loss(pred, batch["y"])
        return loss, {"mse": float(loss.detach())}

    @torch.no_grad()
    def report(self, step, logger) -> dict[str, float]:
        w = self.model.weight.detach()
        if self.is_main:
            logger.text(step, "probe/weights", "| i | w |\n|---|---|\n" +
                        "\n".join(f"| {i} | {v:.4f} |" for i, v in enumerate(w.flatten().tolist())))
            logger.heatmap(step, "probe/weight_outer", (w.T @ w).abs())
        return {"probe/weight_mean": float(w.mean())}

    def evaluate(self):
        return {}


def main(argv: list[str] | None = None) -> int:
    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.distributed.env import init_distributed
    from s2t2_dist.engines.torch_engine import TorchEngine
    from s2t2_dist.train.checkpoint import Checkpointer
    from s2t2_dist.train.config import OptimConfig, TrainConfig
    from s2t2_dist.train.loop import train
    from s2t2_dist.train.metrics import MetricsLogger

    p = argparse.ArgumentParser(prog="python -m s2t2_dist.cluster.probe")
    p.add_argument("--out", required=True, help="run directory (shared by all nodes)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each micro-batch sleeps")
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--config", help="ignored (lets the stage scripts pass their --config)")
    args, _ = p.parse_known_args(argv)  # stage overrides (key=value) are ignored too

    t0 = time.time()
    denv = init_distributed(timeout_s=120)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world, rank = denv.world_size, denv.rank
    (allreduce_sum,) = coll.sum_scalars([float(rank + 1)])
    host = socket.gethostname()
    # node names seen by every rank (SLURMD_NODENAME: the slurmd this task runs under)
    node_name = os.environ.get("SLURMD_NODENAME", host)
    names = coll.all_gather_object(node_name)

    torch.manual_seed(0)
    model = torch.nn.Linear(args.dim, 1, bias=False)
    ocfg = OptimConfig(lr=0.05, eps=1e-8, warmup_frac=0.0, final_lr_frac=1.0, grad_clip=0.0)
    engine = TorchEngine.build(model, ocfg, args.steps, params="replicated")
    cfg = TrainConfig(steps=args.steps, batch_size=2 * world, micro_batch_size=2, log_every=1,
                      ckpt_every=args.ckpt_every, keep_checkpoints=2)
    logger = MetricsLogger(out / "tb", rank=rank, node_rank=denv.node_rank, local_rank=denv.local_rank)
    logger.scalars(0, {"probe/allreduce_sum": allreduce_sum, "probe/world_size": world})
    logger.scalars(0, {"node/local_world_size": denv.local_world_size, "node/node_rank": denv.node_rank},
                   scope="node")
    ck = Checkpointer(out, keep=2, fingerprint={"probe": [args.dim, world]})
    resumed_from = ck.latest()
    result = train(cfg, _Task(model, args.step_time, denv.is_main), engine, _Loader(rank, 2, args.dim, 0), ck,
                   logger, tokens_per_micro_batch=2, progress=False)
    logger.close()

    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    record = {
        "rank": rank, "world_size": world, "local_rank": denv.local_rank, "local_world_size": denv.local_world_size,
        "node_rank": denv.node_rank, "num_nodes": denv.num_nodes, "launcher": denv.launcher,
        "master_addr": denv.master_addr, "master_port": denv.master_port, "hostname": host, "node": node_name,
        "nodes_of_ranks": names, "allreduce_sum": allreduce_sum, "expected_sum": world * (world + 1) / 2,
        "job_id": os.environ.get("SLURM_JOB_ID"), "attempt": attempt, "pid": os.getpid(),
        "resumed_from_step": int(resumed_from.name.split("_")[1]) if resumed_from else 0,
        "step": result.step, "finished": result.finished, "preempted": result.preempted,
        "final_loss": result.losses[-1][1] if result.losses else None, "seconds": round(time.time() - t0, 3),
    }
    (out / "ranks").mkdir(exist_ok=True)
    (out / "ranks" / f"{attempt}_rank{rank:05d}.json").write_text(json.dumps(record, indent=1))
    coll.barrier()
    if rank == 0:
        (out / "result.json").write_text(json.dumps(
            {k: record[k] for k in ("step", "finished", "preempted", "final_loss", "world_size", "job_id")}))
    if coll.initialized():
        from s2t2_dist.distributed.exit import destroy_process_group

        destroy_process_group()
    print(f"probe rank {rank}/{world} on {node_name}: step {result.step} finished={result.finished} "
          f"preempted={result.preempted}", flush=True)
    return 0


if __name__ == "__main__":
    from s2t2_dist.distributed.exit import exit_process

    exit_process(main())  # see distributed/exit.py: seen here, a DeepSpeed-launched rank aborting after this print
