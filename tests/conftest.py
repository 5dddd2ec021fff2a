import functools
import os
import sys
from pathlib import Path

import pytest

# DeepSpeed picks its CPU accelerator without printing a warning to stdout when told explicitly.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO / "tests"))


@functools.cache
def _starts_a_slurm_cluster(module: str) -> bool:
    """A module marked `slurm` (its pytestmark) starts a local SLURM cluster."""
    path = REPO / module
    return path.suffix == ".py" and path.is_file() and "pytest.mark.slurm" in path.read_text()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without the plugin (a plain `pytest`) never called
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2` (the README's test command): one worker runs a whole module, so a module-scoped fixture (a
    launch, a prepared dataset) is built once, and the modules that start a local SLURM cluster share one worker, so
    two clusters never run at once. Modules are handed out in collection order (tests/faults/, the longest, first;
    the many short modules last keep both workers busy to the end), not xdist's default of the most tests first."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "slurm" if _starts_a_slurm_cluster(module) else module

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA
