"""A stop signal to `s2t2 reproduce` while its lanes run: the arms under way checkpoint and stop, no new arm starts,
and the command says so in one true line (exit 130 for Ctrl-C, 0 for SIGTERM); stage processes get each signal once
(they run in sessions of their own, so a terminal's Ctrl-C is not a second one)."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from s2t2_dist.recipes.orchestrate import LIVE, Runner, StageFailed, signal_children
from s2t2_dist.recipes.paper_plan import Job
from s2t2_dist.recipes.reproduce import _stopped
from s2t2_dist.recipes.reproduce_lm import Lanes, _stop_passed_on
from s2t2_dist.utils import stop


def _job(root: Path, name: str) -> Job:
    rd = root / "runs" / name
    return Job(name, "translate", "configs/translate_olmo1b.yaml", [], str(rd), str(rd / "result.json"))


class _LoopRunner:
    """A stage in a lane thread, as an in-process lane runs one: steps until its loop sees a stop request (the
    loop reads utils/stop.outside()), then 'checkpoints' and ends unfinished, as a stopped stage does."""

    def __init__(self, log):
        self.log = log

    def run(self, stage, argv, run_dir, name, result_file=None, inputs=None):
        self.log.append(name)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        for step in range(400):
            if stop.outside() is not None:
                Path(result_file).write_text(json.dumps({"finished": False, "step": step}))
                raise StageFailed(f"{name}: {stage} stopped before its last step (step {step}); rerun to resume")
            time.sleep(0.01)
        Path(result_file).write_text(json.dumps({"finished": True}))
        return name


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_arms_under_way_and_starts_no_other(tmp_path, sig):
    jobs = [_job(tmp_path, n) for n in ("a", "b", "c", "d")]
    log: list = []
    said: list = []
    before = signal.getsignal(sig)
    threading.Timer(0.5, os.kill, (os.getpid(), sig)).start()
    try:
        with _stop_passed_on(said.append):
            lanes = Lanes(2, lambda k: _LoopRunner(log), say=said.append)
            failed = lanes.run(jobs, 0.0)
        assert stop.outside() == sig
    finally:
        stop.request(None)
    assert failed == [] and sorted(lanes.stopped) == ["a", "b"] and sorted(log) == ["a", "b"]
    assert any(f"{signal.Signals(sig).name} received" in m for m in said)
    assert signal.getsignal(sig) is before and stop.outside() is None  # the caller's handlers are back


def test_the_command_says_what_was_stopped_in_one_line(tmp_path, capsys):
    assert _stopped({"signal": signal.SIGINT, "stopped": ["seed0/ft_x"]}, tmp_path) == 130
    assert _stopped({"signal": signal.SIGTERM, "stopped": []}, tmp_path) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"s2t2 reproduce: stopped by SIGINT: 1 arm(s) under way checkpointed (seed0/ft_x); finished "
                      f"arms are recorded in {tmp_path / 'record'}; the same command resumes")
    assert err[1].startswith("s2t2 reproduce: stopped by SIGTERM: no arm was under way")


def test_stage_processes_run_in_sessions_of_their_own_and_get_the_signal_passed_on(tmp_path):
    """A stage process (here a stand-in that exits 0 on SIGTERM, as a stage does after its checkpoint) is in a
    session of its own and ends when the command passes the signal on."""
    script = ("import os, signal, sys, time\nprint(os.getsid(0), flush=True)\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(60)\n")
    r = Runner(ranks=1, in_process=False, log_dir=tmp_path, echo=False)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("log", r._subprocess([sys.executable, "-c", script], "x",
                                                                             "x")))
    t.start()
    for _ in range(200):
        if LIVE and (tmp_path / "x.log").read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert signal_children(signal.SIGTERM) == 1
    t.join(timeout=30)
    assert not t.is_alive() and out["log"] == tmp_path / "x.log" and not LIVE
    sid = int((tmp_path / "x.log").read_text().splitlines()[1])
    assert sid != os.getsid(0)


@pytest.mark.parametrize("raised,rc,name", [("term", 0, "SIGTERM"), ("int", 130, "SIGINT")])
def test_a_local_scale_stopped_by_a_signal_says_so_truly(tmp_path, monkeypatch, capsys, raised, rc, name):
    """The tiny and small scales run their stages one after another: a stop signal (or Ctrl-C) ends the command with
    one true line, not "while starting; nothing was written"."""
    import s2t2_dist.recipes.reproduce as rp

    def stopped(*a, **k):
        raise stop.Stopped(signal.SIGTERM) if raised == "term" else KeyboardInterrupt

    monkeypatch.setattr(rp, "run_local", stopped)
    assert rp.main(["--scale", "tiny", "--out", str(tmp_path / "out"), "--quiet"]) == rc
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"s2t2 reproduce: stopped by {name}: the stage under way was stopped with it (a training stage "
                       f"at its checkpoint); finished stages are kept under {tmp_path / 'out'}; the same command "
                       "resumes"), err
