"""Ctrl-C (SIGINT to the terminal's process group) during translate or finetune checkpoints at the next step
boundary, as SIGTERM does, and the next launch resumes from there: real `s2t2` processes, no periodic checkpoint
in between (train.ckpt_every=0), so every step taken before the Ctrl-C is kept only by that checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tests.helpers.faults_suite import base_env, finetune_args, ledger, translate_args

from s2t2_dist import faults
from s2t2_dist.train.checkpoint import Checkpointer
from tests.helpers.stage_fixtures import REPO


def _launch(stage: str, args: list[str], trace, log, preexec_fn=None):
    out = open(log, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "s2t2_dist.cli", stage, *args], cwd=REPO,
                            env=base_env(**{faults.TRACE_ENV: str(trace)}), stdout=out, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=preexec_fn)
    return proc, out


def _wait_for_step(proc, trace, step: int, out, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [e["step"] for e in faults.read_trace(trace, 0) if e["ev"] == "step" and e["pid"] == proc.pid]
        if steps and max(steps) >= step:
            return max(steps)
        if proc.poll() is not None:
            out.seek(0)
            raise AssertionError(f"ended (rc {proc.returncode}) before step {step}:\n{out.read()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _ctrl_c_at_step_3(stage, args, tmp_path, preexec_fn=None):
    """Launch, press Ctrl-C once step 3 is reached, wait: (the step reached, exit code, output)."""
    trace = tmp_path / "trace"
    proc, out = _launch(stage, args, trace, tmp_path / "l1.log", preexec_fn)
    at = _wait_for_step(proc, trace, 3, out)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rc = proc.wait(timeout=180)
    out.seek(0)
    return at, rc, out.read()


def _ctrl_c_then_resume(stage, args, tmp_path):
    run = tmp_path / "run"
    trace = tmp_path / "trace"
    at, rc, text = _ctrl_c_at_step_3(stage, args, tmp_path)
    assert rc == 0 and "Traceback" not in text, text[-4000:]
    result = json.loads((run / "result.json").read_text())
    assert result["preempted"] and not result["finished"] and result["step"] >= at, result
    assert Checkpointer(run).complete_steps() == [result["step"]]  # only the Ctrl-C checkpoint (ckpt_every=0)
    # the next launch starts from that checkpoint and finishes
    proc, out = _launch(stage, args, trace, tmp_path / "l2.log")
    assert proc.wait(timeout=300) == 0, out.read()
    starts = [e for e in faults.read_trace(trace, 0) if e["ev"] == "start"]
    assert starts[-1]["step"] == result["step"], starts
    final = json.loads((run / "result.json").read_text())
    assert final["finished"] and final["final_loss"] is not None
    return result["step"]


def test_ctrl_c_during_translate_checkpoints_at_the_step_boundary(tiny_data, stories, tmp_path):
    args = translate_args(tiny_data, stories, tmp_path / "run", "train.steps=60", "train.ckpt_every=0",
                          "train.batch_size=2")
    step = _ctrl_c_then_resume("translate", args, tmp_path)
    ledger("translate: Ctrl-C (SIGINT to the process group)", step=step)


@pytest.mark.parametrize("engine", ["plain"])
def test_ctrl_c_during_finetune_checkpoints_at_the_step_boundary(tiny_data, stories, stage1_p, tmp_path, engine):
    args = finetune_args(tiny_data, stories, stage1_p, tmp_path / "run", "train.steps=40", "train.ckpt_every=0",
                         "train.batch_size=2", f"engine.kind={engine}")
    step = _ctrl_c_then_resume("finetune", args, tmp_path)
    ledger("finetune: Ctrl-C (SIGINT to the process group)", step=step)


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it(tiny_data, stories, tmp_path):
    """`nohup s2t2 translate ... &` in a script starts the stage with SIGINT ignored, so that a Ctrl-C meant for the
    script's foreground job does not reach it: the training loop and the export leave it ignored (before: the loop
    took SIGINT over and checkpointed and stopped the run, while the export after it ignored it)."""
    run = tmp_path / "run"
    args = translate_args(tiny_data, stories, run, "train.steps=40", "train.ckpt_every=0", "train.batch_size=2")
    at, rc, text = _ctrl_c_at_step_3("translate", args, tmp_path,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert rc == 0 and "interrupted" not in text and "Traceback" not in text, text[-4000:]
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] and not result["preempted"] and result["step"] == 40 > at, result
    assert (run / "P.safetensors").is_file()
    ledger("translate started with Ctrl-C ignored (nohup ... &): Ctrl-C", step=at)


def test_ctrl_c_under_torchrun_checkpoints_every_rank(tiny_data, stories, tmp_path):
    """Two ranks under torchrun: Ctrl-C reaches the launcher and both ranks; the ranks agree to stop at the same
    step boundary, write one checkpoint together, and exit before the launcher's grace period ends."""
    from tests.helpers.faults_suite import Job

    run = tmp_path / "run"
    job = Job("translate.py", translate_args(tiny_data, stories, run, "train.steps=60", "train.ckpt_every=0"),
              trace=tmp_path / "trace", log=tmp_path / "job.log")
    at = job.wait_for_step(3)["step"]
    job.signal_group(signal.SIGINT)
    job.wait()
    result = json.loads((run / "result.json").read_text())
    assert result["preempted"] and result["step"] >= at, (result, job.output[-3000:])
    assert Checkpointer(run).complete_steps() == [result["step"]]
    ledger("translate, 2 ranks under torchrun: Ctrl-C", step=at)
