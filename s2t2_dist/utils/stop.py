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
- inside the training loop the loop's own handlers take over (checkpoint at the next step boundary, exit 0).

SIGINT (Ctrl-C) keeps Python's KeyboardInterrupt outside the loop: run_main reports it as an interrupt (exit 130).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_state = {"requested": None, "deferred": 0}


class Stopped(BaseException):
    """A stop signal arrived where nothing is being written: the run ends cleanly (exit 0) and resumes later."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


def _handler(signum, frame) -> None:
    _state["requested"] = signum
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


def requested() -> int | None:
    """The stop signal received so far by these handlers (None: none)."""
    return _state["requested"]


def reset() -> None:
    _state["requested"] = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Work that must not be cut short (the final export): a stop signal inside is remembered, not raised."""
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
