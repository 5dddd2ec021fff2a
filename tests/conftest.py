import functools
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

# DeepSpeed picks its CPU accelerator without printing a warning to stdout when told explicitly.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]

# The Ctrl-C tests press Ctrl-C at a terminal: the stages they start must see SIGINT as a terminal's foreground job
# does. A suite started in the background (`nohup pytest ... &` from a script) inherits an ignored SIGINT, which every
# child would keep (the stages leave an ignored SIGINT ignored, as Python does); a handled one is reset on exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SHARED_DATA = REPO.parent / "shared" / "data"


#: a module's marks as the scheduler reads them (xdist's controller collects nothing): its `pytestmark = ...` line
#: and its `@pytest.mark.NAME` decorators, not a mention in a comment or a string
MARK_LINE = re.compile(r"^(?:pytestmark\s*=.*|\s*@)")
MARK_NAME = re.compile(r"pytest\.mark\.(\w+)")


@functools.cache
def _marks(module: str) -> frozenset[str]:
    path = REPO / module
    if not (path.suffix == ".py" and path.is_file()):
        return frozenset()
    return frozenset(m for line in path.read_text().splitlines() if MARK_LINE.match(line)
                     for m in MARK_NAME.findall(line.split("#", 1)[0]))


def _starts_a_slurm_cluster(module: str) -> bool:
    """A module marked `slurm` (its pytestmark) starts a local SLURM cluster."""
    return "slurm" in _marks(module)


def _runs_long(module: str) -> bool:
    """A module with tests marked `slow`, `faults` or `slurm`: end-to-end runs of several processes."""
    return bool(_marks(module) & {"slow", "faults", "slurm"})


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without the plugin (a plain `pytest`) never called
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2` (the README's test command): one worker runs a whole module, so a module-scoped fixture (a
    launch, a prepared dataset) is built once, and the modules that start a local SLURM cluster share one worker, so
    two clusters never run at once. The modules with end-to-end runs (marked slow, faults or slurm) are handed out
    first, in collection order (folder by folder), then the many short ones, so that both workers stay busy to the
    end: a long module handed out last (tests/stages/test_translate_*.py sort late) leaves the other worker idle
    meanwhile.
    Not xdist's default of the most tests first (the longest modules have few tests)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "slurm" if _starts_a_slurm_cluster(module) else module

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_long_first", False):  # once, before the first unit goes out (a stable sort)
                units = sorted(self.workqueue.items(), key=lambda kv: not (kv[0] == "slurm" or _runs_long(kv[0])))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._long_first = True
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


#: S2T2_TEST_TIMELINE=FILE appends one JSON line per test (worker, test, start and end, seconds since the epoch):
#: whether the two workers of `pytest -n 2` end together (`python tests/helpers/scripts/timeline.py FILE`)
TIMELINE_ENV = "S2T2_TEST_TIMELINE"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TIMELINE_ENV)
    start = time.time()
    try:
        return (yield)
    finally:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                                    "start": start, "end": time.time()}) + "\n")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA
