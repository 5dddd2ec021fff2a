"""Signals and a full disk outside the training loop, on real `s2t2 translate` processes:

- SIGUSR1 / SIGTERM (what SLURM sends before the time limit / on preemption) during start-up or model loading, before
  the first step: a clean exit 0 with one line (slurm/common.sh requeues only a step that exited 0; before: killed,
  exit 138, no message), nothing written, and the next launch runs to the end;
- the same signal while the final export is written: the export completes, exit 0, said in one line;
- Ctrl-C while the final export is written: "interrupted", exit 130 (before: "exporting .../final failed: ", exit 1);
- the disk full when P.safetensors is written: one line naming the file and the free space, nothing replaced
  (before: a 41-54-line traceback without the file's name), and after freeing space the same command finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from tests.helpers.faults_suite import base_env, ledger, translate_args

from s2t2_dist import faults
from s2t2_dist.translator.pfile import load_p
from tests.helpers.stage_fixtures import REPO

pytestmark = pytest.mark.faults


def _s2t2(args, **env):
    return subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "translate", *args], cwd=REPO, text=True,
                          capture_output=True, env=base_env(**env), timeout=600)


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "s2t2 translate:" in ln or "Traceback" in ln or "received" in ln]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_during_model_loading_is_a_clean_stop_then_the_run_completes(tmp_path, tiny_data, stories, sig):
    run = tmp_path / "run"
    args = translate_args(tiny_data, stories, run, "train.steps=4")
    proc = subprocess.Popen([sys.executable, "-m", "s2t2_dist.cli", "translate", *args], cwd=REPO, text=True,
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / ".s2t2.lock").exists():  # setup took the lock: the model is being loaded next
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert _errors(err) == [f"s2t2 translate: stopped by {sig.name} outside the training steps (start-up, model "
                            "loading); nothing was being written: a requeued or repeated run resumes from the last "
                            "checkpoint"]
    assert not (run / "checkpoints").exists() and not (run / "result.json").exists()
    p = _s2t2(args)  # the requeued job
    assert p.returncode == 0 and (run / "P.safetensors").is_file(), p.stderr[-3000:]
    ledger(f"{sig.name} during model loading (before the first step)")


@pytest.mark.parametrize("sig", ["sigusr1", "sigterm"])
def test_signal_during_the_final_export_lets_it_complete(tmp_path, tiny_data, stories, sig):
    run = tmp_path / "run"
    p = _s2t2(translate_args(tiny_data, stories, run, "train.steps=4"), **{faults.ENV: f"{sig}_in_export:4"})
    assert p.returncode == 0, p.stderr[-3000:]
    name = sig.upper()
    assert _errors(p.stderr) == [f"{name} received: stopping once the export in progress is complete",
                                 f"s2t2 translate: {name} arrived during the final export; the export completed "
                                 "and the run is finished"]
    assert load_p(run / "P.safetensors").shape[0] > 0
    ledger(f"{name} during the final export")


def test_ctrl_c_during_the_final_export_is_an_interrupt(tmp_path, tiny_data, stories):
    run = tmp_path / "run"
    args = translate_args(tiny_data, stories, run, "train.steps=4")
    p = _s2t2(args, **{faults.ENV: "sigint_in_export:4"})
    assert p.returncode == 130, p.stderr[-3000:]
    assert _errors(p.stderr) == ["s2t2 translate: interrupted (Ctrl-C); a run resumes from its last checkpoint"]
    assert not (run / "P.safetensors").exists() and not list(run.glob(".P.safetensors*"))
    p = _s2t2(args)
    assert p.returncode == 0 and (run / "P.safetensors").is_file()
    ledger("Ctrl-C during the final export")


def test_disk_full_while_writing_the_p_file_names_it(tmp_path, tiny_data, stories, monkeypatch):
    """A real full disk (tmpfs) at the P-file write, in the process of `s2t2 translate` (the fill happens as the
    export begins, through the export's fault point)."""
    from tests.faults.test_disk_full import fill

    disk = tmp_path / "small_disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        run = disk / "run"
        args = translate_args(tiny_data, stories, run, "train.steps=4")
        from s2t2_dist.stages import translate

        real = translate.export_p

        def export_p(path, task, hashes):
            fill(disk)
            return real(path, task, hashes)

        monkeypatch.setattr(translate, "export_p", export_p)
        monkeypatch.setenv("S2T2_DEVICE", "cpu")
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = translate.main(args)
        assert rc == 2
        line = [ln for ln in err.getvalue().splitlines() if ": error: " in ln]
        assert len(line) == 1 and line[0].startswith(
            f"s2t2 translate: error: WriteError: [Errno 28] writing {run}/P.safetensors failed: the disk is full ("), \
            err.getvalue()[-3000:]
        assert not (run / "P.safetensors").exists() and not list(run.glob(".P.safetensors*"))
        (disk / "filler").unlink()
        monkeypatch.setattr(translate, "export_p", real)
        assert translate.main(args) == 0 and load_p(run / "P.safetensors").shape[0] > 0
        ledger("disk full while the P file is written (real tmpfs)")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _batch_shell(tmp_path, srun: str, args: str, **env_extra) -> tuple[list[str], dict]:
    """slurm/common.sh's `s2t2_srun` running `s2t2 translate ARGS`, with the stand-in `srun` script given and an
    `scontrol` that prints its arguments: the bash command and its environment."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(srun)
    (bin_ / "scontrol").write_text('#!/bin/sh\necho "scontrol $*"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in base_env().items() if not k.startswith("SLURM_")}
    env.update({"PATH": f"{bin_}:{env['PATH']}", "S2T2_HOME": str(REPO), "S2T2_PYTHON": sys.executable,
                "SLURM_JOB_ID": "7", **env_extra})
    return ["bash", "-c", f". slurm/common.sh; s2t2_srun -- {sys.executable} -m s2t2_dist.cli translate {args}"], env


def test_batch_script_requeues_a_step_stopped_before_its_first_step(tmp_path, tiny_data, stories):
    """slurm/common.sh end to end with stand-ins for srun and scontrol: the time-limit warning (SIGUSR1 to the batch
    shell) arrives while the stage loads its model; s2t2_srun forwards it, the stage stops cleanly (exit 0) and the
    shell requeues the job (before: the stage died with exit 138 and the job chain ended)."""
    run = tmp_path / "run"
    cmd, env = _batch_shell(tmp_path, '#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
                            " ".join(translate_args(tiny_data, stories, run, "train.steps=4")))
    shell = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / ".s2t2.lock").exists():
        assert shell.poll() is None and time.monotonic() < deadline, shell.communicate()
        time.sleep(0.01)
    shell.send_signal(signal.SIGUSR1)  # what SLURM's --signal=B:USR1@LEAD sends to the batch shell
    out, err = shell.communicate(timeout=300)
    assert "s2t2 translate: stopped by SIGUSR1 outside the training steps" in err, err[-3000:]
    assert "job step exited with code 0" in err and "scontrol requeue 7" in out, (out, err[-3000:])
    assert not (run / "result.json").exists()
    ledger("SIGUSR1 to the batch shell during model loading: clean stop, requeued")


# The stand-in srun runs the step to its end, then sends the time-limit warning to the batch shell (its parent) and
# waits until s2t2_srun's handler has forwarded it back: the shell has taken the warning before the step exits.
LATE_SRUN = """#!/bin/bash
while [ "${1#-}" != "$1" ]; do shift; done
got=; trap 'got=1' USR1
"$@"; rc=$?
kill -USR1 "$PPID"
while [ -z "$got" ]; do sleep 0.05; done
exit "$rc"
"""


def test_batch_script_does_not_requeue_a_finished_run(tmp_path, tiny_data, stories):
    """The warning reaches the batch shell after the step's work: the run is finished (result written), so it is not
    requeued (before: requeued, and the next attempt exported and evaluated it again). A step stopped with work left
    is requeued: the test above (before its first step) and tests/cluster/test_slurm_cluster.py (at the time limit)."""
    run = tmp_path / "run"
    cmd, env = _batch_shell(tmp_path, LATE_SRUN, " ".join(translate_args(tiny_data, stories, run, "train.steps=4")),
                            TMPDIR=str(tmp_path))
    shell = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=600)
    out, err = shell.stdout, shell.stderr
    assert shell.returncode == 0 and "job step exited with code 0" in err, err[-3000:]
    assert "SIGUSR1 (time limit close or preemption notice)" in err, err[-3000:]
    assert (run / "result.json").is_file() and (run / "P.safetensors").is_file()
    assert "scontrol" not in out, (out, err[-3000:])
    assert "the run finished (the warning came during its final export or after it); not requeued" in err
    assert not list(tmp_path.glob("s2t2-step-*"))  # the report directory is removed
    ledger("the time-limit warning after the step's work: a finished run is not requeued")


def test_submitit_job_returns_its_result_when_the_signal_came_during_the_final_export(tmp_path, tiny_data, stories):
    """`s2t2 submit`'s StageJob in a one-task SLURM environment: a stop signal during the final export lets the run
    finish, and the job returns its result instead of exiting without one for submitit to resubmit."""
    run = tmp_path / "run"
    code = ("import json, sys\nfrom s2t2_dist.cluster.submit import StageJob\n"
            "print('RESULT', json.dumps(StageJob('translate', sys.argv[1:])()))")
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NTASKS": "1",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
             "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1", "SUBMITIT_EXECUTOR": "slurm"}
    env = {k: v for k, v in base_env(**{faults.ENV: "sigusr1_in_export:4"}).items() if not k.startswith("SLURM_")}
    p = subprocess.run([sys.executable, "-c", code, *translate_args(tiny_data, stories, run, "train.steps=4")],
                       cwd=REPO, text=True, capture_output=True, env={**env, **slurm}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "exits without a result" not in p.stderr, p.stderr[-3000:]
    assert "SIGUSR1 arrived during the final export; the export completed and the run is finished" in p.stderr
    assert 'RESULT {"stage": "translate", "rank": 0, "world_size": 1, "rc": 0}' in p.stdout, p.stdout[-2000:]
    assert (run / "P.safetensors").is_file() and '"finished": true' in (run / "result.json").read_text()
