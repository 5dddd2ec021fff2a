"""One rank of a real multi-process engine run, started by the real launchers in tests/engines/test_engines_*.py
(tests/helpers/engines_launch.py), from the repository root with it on PYTHONPATH:

    deepspeed --num_gpus 2 tests/helpers/scripts/engines_script.py --engine deepspeed --ds_config configs/ds_zero3.json \
        --run_dir D ...
    torchrun --standalone --nproc_per_node 2 tests/helpers/scripts/engines_script.py --engine fsdp --run_dir D ...

It trains a tiny OLMo with the project's train.loop.train (an LM loss on a small pool of random token blocks), and
writes what the test checks into OUT/results_rankN.json (+ logits.pt): the loss curve, lr, per-rank parameter
elements, optionally a consolidated export and a non-finite-step check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from s2t2_dist.engines.launcher import parse_launcher_args
from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.train.config import OptimConfig, TrainConfig
from s2t2_dist.train.loop import Task, train
from s2t2_dist.train.metrics import MetricsLogger
from tests.helpers.engines_tiny import tiny_olmo, tiny_olmo_config  # (the launchers put the repository on PYTHONPATH)
class BlockLoader:
    """A fixed pool of random token blocks over a small alphabet (so a few steps visibly lower the loss), this
    rank's share, in order; resumable by position."""

    def __init__(self, vocab: int, n_seq: int, seq_len: int, micro: int, rank: int, world: int, seed: int = 1234,
                 alphabet: int = 16):
        g = torch.Generator().manual_seed(seed)
        pool = torch.randint(2, 2 + alphabet, (n_seq, seq_len), generator=g)
        mine = pool[rank::world]
        self.batches = [mine[i:i + micro] for i in range(0, len(mine) - micro + 1, micro)]
        self.pos = 0

    def __iter__(self):
        while self.pos < len(self.batches):
            i = self.pos
            self.pos += 1
            yield {"input_ids": self.batches[i]}
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = int(s["pos"])


class LMTask(Task):
    def __init__(self, engine):
        self.engine = engine

    def loss(self, batch):
        ids = batch["input_ids"].to(self.engine.device)
        return self.engine.module(input_ids=ids, labels=ids).loss, {}

    def report(self, step, logger):
        return {}

    def evaluate(self):
        return {}


def main(argv=None):
    launcher, rest = parse_launcher_args(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["deepspeed", "fsdp", "plain"], required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop_after", type=int, default=0)
    ap.add_argument("--tie", type=int, default=1)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--export", default=None)
    ap.add_argument("--nan_check", action="store_true")
    ap.add_argument("--persistence0", type=int, default=1, help="ZeRO-3: stage3_param_persistence_threshold=0")
    ap.add_argument("--ds_override", default="{}", help="JSON merged over the DeepSpeed config")
    ap.add_argument("--init_from", default=None, help="a transformers checkpoint to start from (from_pretrained)")
    ap.add_argument("--act_ckpt", action="store_true", help="activation checkpointing")
    args = ap.parse_args(rest)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.engine == "deepspeed":
        from s2t2_dist.engines.deepspeed_engine import init_deepspeed_distributed

        denv = init_deepspeed_distributed()
    else:
        from s2t2_dist.distributed.env import init_distributed

        denv = init_distributed()
    rank, world = denv.rank, denv.world_size

    tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro, context_len=args.seq,
                       seed=0, log_every=1, ckpt_every=0, stop_after=args.stop_after, precision="auto")
    ocfg = OptimConfig(lr=args.lr, weight_decay=0.01, warmup_frac=0.2, final_lr_frac=0.1, grad_clip=1.0)
    hf_cfg = tiny_olmo_config(bool(args.tie))
    if args.init_from:
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(args.init_from)

    if args.engine == "deepspeed":
        from s2t2_dist.engines.build import EngineConfig, build_model_and_engine
        from s2t2_dist.engines.deepspeed_engine import merge_config, partitioned_numel

        if launcher.ds_config is None:
            raise SystemExit("--ds_config is required for --engine deepspeed")
        over = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if args.persistence0 else {}
        over = merge_config(over, json.loads(args.ds_override))
        ecfg = EngineConfig(kind="deepspeed", ds_config=launcher.ds_config, ds_overrides=over,
                            activation_checkpointing=args.act_ckpt)
        # the finetune stage's call: a checkpoint directory or a config, built straight into ZeRO-3 partitions
        model, engine = build_model_and_engine(ecfg, args.init_from or hf_cfg, ocfg, tcfg)
        local, total = partitioned_numel(engine.model)
    elif args.engine == "fsdp":
        from s2t2_dist.engines.fsdp_engine import FSDP2Engine
        from s2t2_dist.models.hf import local_numel

        model = _plain_model(args, hf_cfg)
        engine = FSDP2Engine.build(model, ocfg, tcfg, activation_checkpointing=args.act_ckpt)
        local, total = local_numel(engine.model)
    else:
        from s2t2_dist.engines.build import EngineConfig, build_model_and_engine

        model, engine = build_model_and_engine(EngineConfig(activation_checkpointing=args.act_ckpt),
                                               _plain_model(args, hf_cfg), ocfg, tcfg)
        local = total = sum(p.numel() for p in model.parameters())

    loader = BlockLoader(hf_cfg.vocab_size, 32, args.seq, args.micro, rank, world)
    task = LMTask(engine)
    ckpt = Checkpointer(args.run_dir, keep=2, fingerprint={"engine": args.engine})
    logger = MetricsLogger(Path(args.run_dir) / "tb", rank, 0, denv.local_rank, enabled=False)
    probe = torch.randint(2, hf_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(99))
    if args.init_from:  # the logits of the starting point, before any step
        engine.eval()
        with torch.no_grad():
            logits0 = engine.module(input_ids=probe.to(engine.device)).logits.float().cpu()
        engine.train()
        if rank == 0:
            torch.save({"probe": probe, "logits": logits0}, out / "logits_init.pt")
    lrs = []
    res = train(tcfg, task, engine, loader, ckpt, logger, progress=False,
                on_step=lambda s, l: lrs.append((s, engine.lr())))
    results = {"rank": rank, "world": world, "losses": res.losses, "lrs": lrs, "finished": res.finished,
               "preempted": res.preempted, "step": res.step, "bad_steps": res.bad_steps,
               "local_numel": local, "total_numel": total}

    if args.export:
        engine.eval()
        with torch.no_grad():
            logits = engine.module(input_ids=probe.to(engine.device)).logits.float().cpu()
        engine.train()
        engine.export_consolidated(args.export)
        if rank == 0:
            torch.save({"probe": probe, "logits": logits}, out / "logits.pt")

    if args.nan_check:
        results["nan_check"] = nan_check(engine, task, loader, tcfg, rank, world)

    (out / f"results_rank{rank}.json").write_text(json.dumps(results))
    from s2t2_dist.stages.common import teardown

    teardown()  # barrier, destroy, and mark the process for exit_process


def _plain_model(args, hf_cfg):
    if args.init_from:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    return tiny_olmo(bool(args.tie), seed=0)


def nan_check(engine, task, loader, tcfg, rank, world):
    """A micro-batch whose loss is NaN on rank 1 only: the step must be skipped on every rank, weights unchanged,
    the schedule advanced; the next clean step is applied."""
    accum = tcfg.grad_accum(world)
    data = iter(loader)

    def one_step(poison: bool):
        for _ in range(accum):
            try:
                batch = next(data)
            except StopIteration:
                return None
            loss, _ = task.loss(batch)
            if poison and rank == 1:
                loss = loss * float("nan")
            engine.backward(loss / accum)
        return engine.step()

    before = engine.consolidated_state_dict()
    lr0, sched0 = engine.lr(), engine.scheduler.last_epoch
    norm, applied = one_step(True)
    after = engine.consolidated_state_dict()
    lr1, sched1 = engine.lr(), engine.scheduler.last_epoch
    unchanged = all(torch.equal(before[k], after[k]) for k in before) if rank == 0 else None
    norm2, applied2 = one_step(False)
    after2 = engine.consolidated_state_dict()
    changed = any(not torch.equal(after[k], after2[k]) for k in after) if rank == 0 else None
    return {"norm": norm, "applied": applied, "unchanged": unchanged, "lr_before": lr0, "lr_after": lr1,
            "sched_before": sched0, "sched_after": sched1,
            "norm2": norm2, "applied2": applied2, "changed2": changed}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from s2t2_dist.distributed.exit import exit_process

    main()
    exit_process(0)
