"""Start-up phases a user can see: each is logged on rank 0 when it begins and when it ends (with its seconds), so a
stall before the first step shows which phase it is in, and the stage keeps them in result.json (``startup``).

    with phases.phase("model load"):
        model = ...

One recorder per process (``reset`` at a stage's start, in stages/common.run_stage), so an engine's build can mark
its own phases (sharding, optimiser) without a timer passed through every signature. Phases may nest (an engine's
phases inside the stage's build); each is recorded under its own name, summed if it repeats.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("s2t2.startup")

#: seconds a phase runs before its start is logged
ANNOUNCE_S = 1.0

#: the phase from the loop's start to the end of its first step (any lazy compile included)
FIRST_STEP = "first step"


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), so the imports before the stage's start are counted."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class Phases:
    def __init__(self):
        self.t0 = time.perf_counter()
        age = _process_age_s()
        #: seconds from the process's start to reset(): interpreter, imports, argument parsing
        self.before_s = age
        self.seconds: dict[str, float] = {}
        self.ended_at: dict[str, float] = {}  # seconds from the stage's start to each phase's (last) end
        self._open: dict[str, float] = {}
        self._announce: dict[str, threading.Timer] = {}

    @staticmethod
    def _main() -> bool:  # before the process group exists the launcher's RANK says who logs
        return os.environ.get("RANK", "0") in ("", "0")

    def begin(self, name: str) -> None:
        self._open[name] = time.perf_counter()
        if self._main():
            # said only once the phase has lasted ANNOUNCE_S: a stall shows which phase it is in, while a user error
            # found at once stays the one line it is
            t = threading.Timer(ANNOUNCE_S, log.info, ("startup: %s ...", name))
            t.daemon = True
            self._announce[name] = t
            t.start()

    def end(self, name: str, ok: bool = True) -> float | None:
        t = self._open.pop(name, None)
        timer = self._announce.pop(name, None)
        if timer is not None:
            timer.cancel()
        if t is None:
            return None
        dt = time.perf_counter() - t
        self.seconds[name] = self.seconds.get(name, 0.0) + dt
        self.ended_at[name] = self.elapsed()
        if self._main() and ok:  # a phase that raised: its error is what the user reads
            log.info("startup: %s took %.2f s (%.1f s since the stage started)", name, dt, self.elapsed())
        return dt

    @contextlib.contextmanager
    def phase(self, name: str):
        self.begin(name)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.end(name, ok)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def summary(self) -> dict:
        """For result.json: each phase's seconds (in the order they ended), the process's age when the stage
        started (interpreter and imports) and the seconds from the stage's start to the end of its first training
        step (None without one)."""
        first = self.ended_at.get(FIRST_STEP)
        return {"phases_s": {k: round(v, 3) for k, v in self.seconds.items()},
                "before_stage_s": None if self.before_s is None else round(self.before_s, 3),
                "first_step_done_s": None if first is None else round(first, 3)}


_current = Phases()


def reset() -> Phases:
    """A fresh recorder (a stage's start); returns it."""
    global _current
    _current = Phases()
    return _current


def current() -> Phases:
    return _current


def phase(name: str):
    """Context manager timing a start-up phase of the current recorder."""
    return _current.phase(name)


def begin(name: str) -> None:
    _current.begin(name)


def end(name: str) -> float | None:
    return _current.end(name)
