"""SIGTERM and SIGUSR1 at every moment of a run, not only inside the training loop.

SLURM sends SIGUSR1 before the time limit (`--signal=B:USR1@LEAD`, forwarded by slurm/common.sh) and SIGTERM on
preemption or `scontrol requeue`; the default action of both kills the process (exit 138 / 143, no message), and
slurm/common.sh requeues only a step that exited 0. So `install()` (first thing in `s2t2 ...` and in run_main, before
any model is loaded) replaces them:

- outside the loop and outside `deferred()` (start-up, model loading, before the first step) the signal raises
  `Stopped`: nothing is being written there, run_main says so in one line and exits 0, and the launch script
  requeues the job, which starts again from its last checkpoint;
- inside `deferred()` (the final export) it is remembered and the export completes (it is atomic and short next to
  the signal's lead time); the stage then exits 0 as usual and says that it was signalled;
- inside the training loop the loop's own handlers take over (checkpoint at the next step boundary, exit 0);
- once the run's result is written (`finish()`) it is only remembered: nothing is left to stop, and a clean stop
  there would make the launcher requeue a finished run. `tell_launcher()` then creates
  S2T2_STEP_REPORT_DIR/finished, which slurm/common.sh reads before it requeues.

SIGINT (Ctrl-C) keeps Python's KeyboardInterrupt outside the loop: run_main reports it as an interrupt (exit 130).
A SIGINT ignored when the process started (`nohup ... &` in a script) stays ignored, in the loop too.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_state = {"requested": None, "deferred": 0, "finished": False, "late": False}


class Stopped(BaseException):
    """A stop signal arrived where nothing is being written: the run ends cleanly (exit 0) and resumes later."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


def _handler(signum, frame) -> None:
    _state["requested"] = signum
    if _state["finished"]:
        _state["late"] = True  # after the result: run_main says so
        return
    if _state["deferred"]:
        print(f"{name(signum)} received: stopping once the export in progress is complete", file=sys.stderr,
              flush=True)
        return
    raise Stopped(signum)


def install() -> dict:
    """Own SIGTERM and SIGUSR1 from now on (main thread only; elsewhere signals stay as they are). Returns the
    handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _handler) for s in SIGNALS}


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """`install()` for the duration of an entry point, then the previous handlers back: an entry point run inside
    another program (tests, the recipes, the misuse table's generator) leaves that program's signals as they were."""
    old = install()
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


#: a stop asked for by the process's owner on behalf of a stage it runs in another thread (a reproduction's lane),
#: where the stage cannot install handlers: the training loop reads it at each step boundary (not reset per stage)
_outside: list[int | None] = [None]


def request(signum: int | None) -> None:
    """Ask every training loop of this process to checkpoint and stop at its next step (None: withdraw)."""
    _outside[0] = signum


def outside() -> int | None:
    """The stop asked for by :func:`request` (None: none)."""
    return _outside[0]


def requested() -> int | None:
    """The stop signal received so far by these handlers (None: none)."""
    return _state["requested"]


def reset() -> None:
    _state.update(requested=None, finished=False, late=False)


def finish() -> None:
    """The run's work is complete and its result written: a stop signal from now on is only remembered."""
    _state["finished"] = True


def finished() -> bool:
    return _state["finished"]


def arrived_late() -> bool:
    """Whether the stop signal came after finish() (not during the final export)."""
    return _state["late"]


#: the file in S2T2_STEP_REPORT_DIR that says "this job step's run is finished"
FINISHED = "finished"


def tell_launcher(is_main: bool) -> None:
    """Rank 0 (`is_main`, the caller's rank) of a finished run: create S2T2_STEP_REPORT_DIR/finished when the
    launcher set it (slurm/common.sh, one directory per job step), so that a time-limit warning that reached the
    batch shell during the final export or after it does not requeue a run that has nothing left to do."""
    from pathlib import Path

    from s2t2_dist import envvars

    d = envvars.get("S2T2_STEP_REPORT_DIR")
    if d and is_main:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / FINISHED).write_text("finished\n")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Work that must not be cut short (the final export): a stop signal inside is remembered, not raised."""
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
