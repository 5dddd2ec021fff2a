"""The run directory is watched: rank 0 re-checks its lock file and owner marker before each
checkpoint, each metrics write and the result; a lock file deleted or replaced, a marker of another run, or the
directory removed mid-run stop the run with one line instead of writing on (before: a second identical run could
work beside it; a removed directory was re-created and written into)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from tests.helpers.faults_suite import base_env, translate_args
from tests.helpers.scripts.misuse_table import remove_at_once

from s2t2_dist.utils import rundir
from s2t2_dist.utils.rundir import claim, release_all, verify
from s2t2_dist.errors import RunDirError
from tests.helpers.stage_fixtures import REPO

pytestmark = pytest.mark.faults


def test_verify_sees_each_change(tmp_path):
    d = tmp_path / "run"
    try:
        m = claim(d, "translate")
        verify(d)  # untouched: fine
        (d / rundir.MARKER).write_text(json.dumps({**m, "run_id": "0123456789ab"}))
        with pytest.raises(RunDirError, match=r"is now owned by another run \(.s2t2_run.json: translate run "
                                              r"0123456789ab, not this run " + m["run_id"]):
            verify(d, before="writing checkpoint step_00000004")
        (d / rundir.MARKER).write_text("")  # what a reader sees halfway through another run's plain write
        with pytest.raises(RunDirError, match=r"has an owner marker .s2t2_run.json that is not a run's JSON"):
            verify(d)
        (d / rundir.MARKER).unlink()
        with pytest.raises(RunDirError, match=r"lost its owner marker .s2t2_run.json \(deleted\)"):
            verify(d)
        (d / rundir.MARKER).write_text(json.dumps(m))
        (d / rundir.LOCK).unlink()
        with pytest.raises(RunDirError, match="lost its lock file"):
            verify(d)
        (d / rundir.LOCK).write_text("{}")  # what a second run's lock() would create
        with pytest.raises(RunDirError, match="has a new lock file"):
            verify(d)
        shutil.rmtree(d)
        with pytest.raises(RunDirError, match=r"was removed while this run was using it; stopping instead of"):
            verify(d)
        verify(tmp_path / "never_claimed")  # not this process's: nothing to check
    finally:
        release_all()


def _run_then(tmp_path, tiny_data, stories, change) -> tuple[subprocess.CompletedProcess, object]:
    run = tmp_path / "run"
    args = translate_args(tiny_data, stories, run, "train.steps=60", "train.ckpt_every=2", "train.log_every=1")
    proc = subprocess.Popen([sys.executable, "-m", "s2t2_dist.cli", "translate", *args], cwd=REPO, text=True,
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_00000002").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    change(run)
    out, err = proc.communicate(timeout=300)
    return proc, err


def test_lock_file_deleted_mid_run_stops_it(tmp_path, tiny_data, stories):
    proc, err = _run_then(tmp_path, tiny_data, stories, lambda run: (run / rundir.LOCK).unlink())
    lines = [ln for ln in err.splitlines() if "error" in ln or "Traceback" in ln]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"s2t2 translate: error: RunDirError: run_dir: {tmp_path / 'run'} lost its lock file "
                               "(deleted) while this run was using it; stopping instead of ")
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert "step_00000060" not in steps and not (tmp_path / "run" / "result.json").exists()


def test_run_dir_removed_mid_run_is_not_recreated(tmp_path, tiny_data, stories):
    proc, err = _run_then(tmp_path, tiny_data, stories, remove_at_once)
    lines = [ln for ln in err.splitlines() if "error" in ln or "Traceback" in ln]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    assert f"run_dir: {tmp_path / 'run'} was removed while this run was using it" in lines[0]
    assert not (tmp_path / "run").exists()


_RACE = """
import shutil, sys
from pathlib import Path
from s2t2_dist.errors import RunDirError
from s2t2_dist.train.metrics import MetricsLogger
from s2t2_dist.utils.rundir import claim

d = Path(sys.argv[1])
claim(d, "translate")
log = MetricsLogger(d / "tb", rank=0, node_rank=0, local_rank=0, flush_secs=1)
log.scalars(0, {"loss": 1.0})
log.flush()
shutil.rmtree(d)
writer = log._global
writer.add_scalar("loss", 2.0, 1)  # past the check, as a write racing the removal is
worker = writer.file_writer.event_writer._async_writer._worker
worker.join(timeout=60)
print(type(worker.exception).__name__)
try:
    log.scalars(2, {"loss": 3.0})
except RunDirError as e:
    print("stopped:", e)
"""


def test_metrics_write_queued_before_the_directory_went_is_said_once(tmp_path):
    """The race of a removal with TensorBoard's writer thread: a point queued just before the directory is removed
    fails in that thread; no traceback escapes it, and the next write stops the run with the one-line error (in a
    process of its own: pytest replaces the thread hook in-process)."""
    d = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", _RACE, str(d)], cwd=REPO, env=base_env(), text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0] == "FileNotFoundError", r.stdout
    assert "stopped: run_dir:" in r.stdout and "was removed while this run was using it" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not d.exists()
