"""The reliability suite's tools (tests/faults/): the fault ledger, a tiny real dataset (a few real protein records
-> prepared shards), the stage arguments of its small runs, and `Job`, a 2-rank torchrun launch of a stage that a test
can SIGKILL, SIGTERM or SIGUSR1 from outside while reading its progress from the fault trace (s2t2_dist.faults). Its
fixtures (built once per test run) are in tests/faults/conftest.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from s2t2_dist import faults
from tests.helpers.stage_fixtures import REPO, protein_fasta

__all__ = ["DS_ZERO3", "LEDGER_ENV", "REPO", "TRANSLATE_STEPS", "Job", "base_env", "finetune_args", "ledger",
           "prepare_tiny", "translate_args", "write_tiny_fasta"]

#: every injection made by the suite is appended here (one JSON line each) when set: docs/reliability.md counts
LEDGER_ENV = "S2T2_FAULTS_LEDGER"


def ledger(fault: str, lost: str = "nothing", **info) -> None:
    path = os.environ.get(LEDGER_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"fault": fault, "lost": lost, **info}) + "\n")



def write_tiny_fasta(out: Path, n_records: int = 14) -> Path:
    """The first records of the shipped real protein FASTA."""
    lines, n = [], 0
    for line in protein_fasta().read_text().splitlines():
        if line.startswith(">"):
            n += 1
            if n > n_records:
                break
        lines.append(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def prepare_tiny(out: Path, fasta: Path, shard_size: int = 16, context_len: int = 64, vocab_size: int = 64,
                 num_workers: int = 0) -> Path:
    from s2t2_dist.data.config import DataConfig
    from s2t2_dist.data.pipeline import prepare

    cfg = DataConfig(inputs=[str(fasta)], eval_fraction=0.1, vocab_size=vocab_size, context_len=context_len,
                     shard_size=shard_size, output_dir=str(out), extra_residue_policy="keep", num_workers=num_workers)
    prepare(cfg, progress=False)
    return out



def translate_args(data: Path, model: Path, run_dir: Path, *extra: str) -> list[str]:
    """A small stage-1 run: 2 ranks x 2 sequences of 64 tokens per step, C sharded over the ranks."""
    return [f"run_dir={run_dir}", f"model.path={model}", "model.source_vocab=all",
            f"data.train={data}/shards/new/train", f"data.tokenizer={data}/tokenizer", "data.num_workers=0",
            "data.shuffle_window=16", "train.context_len=64", "train.batch_size=4", "train.micro_batch_size=2",
            "train.log_every=1000", "train.ckpt_every=2", "train.keep_checkpoints=2", "train.eval_every=0",
            "optim.lr=3.90625e-5", "optim.warmup_frac=0.1", "translator.heatmap=[8,8]", *extra]  # lr 0.02 / v, v = 512


def base_env(**extra: str) -> dict:
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(REPO) + os.pathsep + e.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
              "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "S2T2_DEVICE": "cpu",
              "S2T2_LOG_LEVEL": "WARNING"})
    for k in (faults.ENV, faults.TRACE_ENV):
        e.pop(k, None)
    e.update(extra)
    return e


class Job:
    """One launch of a stage under torchrun (its own process group, as a SLURM job step)."""

    def __init__(self, script: str, args: list[str], *, nproc: int = 2, trace: Path | None = None,
                 fault: str | None = None, env: dict | None = None, log: Path | None = None):
        self.trace = trace
        self.nproc = nproc
        # start events already in the trace (earlier launches): this launch's ranks are the ones after them
        self._old_starts = {r: len(self._starts(r)) for r in range(nproc)} if trace is not None else {}
        extra = dict(env or {})
        if trace is not None:
            extra[faults.TRACE_ENV] = str(trace)
        if fault:
            extra[faults.ENV] = fault
        self.fault = fault
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--monitor_interval=0.2",
               str(REPO / "launch" / script), *args]
        self.log = log
        self._out = open(log, "w+") if log is not None else subprocess.PIPE
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(**extra), stdout=self._out,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output = ""

    def wait(self, timeout: float = 240) -> int:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            raise AssertionError(f"job timed out after {timeout} s:\n{self.read_output(out)[-6000:]}")
        self.output = self.read_output(out)
        return self.proc.returncode

    def read_output(self, out) -> str:
        if self.log is None:
            return out or ""
        self._out.flush()
        self._out.seek(0)
        return self._out.read()

    def expect(self, rc_ok: bool, timeout: float = 240) -> str:
        rc = self.wait(timeout)
        if (rc == 0) != rc_ok:
            raise AssertionError(f"rc={rc} (fault {self.fault!r}), expected {'0' if rc_ok else 'a failure'}:\n"
                                 f"{self.output[-8000:]}")
        return self.output

    def events(self, rank: int) -> list[dict]:
        return faults.read_trace(self.trace, rank)

    def _starts(self, rank: int) -> list[int]:
        return [e["pid"] for e in faults.read_trace(self.trace, rank) if e["ev"] == "start"]

    def _check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            rc = self.wait()
            raise AssertionError(f"job ended (rc {rc}) before {what}:\n{self.output[-6000:]}")

    def rank_pid(self, rank: int, timeout: float = 180) -> int:
        """The pid of this launch's `rank` (waits until it has started training)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            starts = self._starts(rank)
            if len(starts) > self._old_starts[rank]:
                return starts[-1]
            self._check_alive(f"rank {rank} started")
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} did not start in {timeout} s")

    def wait_for_step(self, step: int, rank: int = 0, timeout: float = 180) -> dict:
        """Block until this launch's `rank` finished optimiser step >= `step`; returns that trace event."""
        pid = self.rank_pid(rank, timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mine = [e for e in self.events(rank) if e["pid"] == pid and e["ev"] == "step" and e["step"] >= step]
            if mine:
                return mine[0]
            self._check_alive(f"step {step}")
            time.sleep(0.05)
        raise AssertionError(f"rank {rank} did not reach step {step} in {timeout} s")

    def signal_group(self, sig: int) -> None:
        """What SLURM does at preemption: the signal to every process of the step (launcher and ranks)."""
        os.killpg(self.proc.pid, sig)



DS_ZERO3 = ["--ds_config", "configs/ds_zero3.json",
            "engine.ds_overrides.zero_optimization.stage3_param_persistence_threshold=0"]


def finetune_args(data: Path, model: Path, p_file: Path, run_dir: Path, *extra: str) -> list[str]:
    """A small stage-2 run: the whole stories260K model, translated to the tiny tokenizer by a stage-1 P."""
    return [f"run_dir={run_dir}", f"model.path={model}", f"data.train={data}/shards/new/train",
            f"data.tokenizer={data}/tokenizer", "data.num_workers=0", "data.shuffle_window=16", f"init.p_file={p_file}",
            "train.context_len=64", "train.batch_size=4", "train.micro_batch_size=2", "train.log_every=1000",
            "train.ckpt_every=2", "train.keep_checkpoints=2", "train.eval_every=0", "optim.lr=1e-3", *extra]


#: optimiser steps of the translate runs compared with each other (80 blocks / (2 ranks x 2) = 20 steps per epoch:
#: the runs cross an epoch boundary)
TRANSLATE_STEPS = 30
