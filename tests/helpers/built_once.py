"""A session fixture's files built once per test run, not once per pytest-xdist worker: the workers of `pytest -n 2`
share the run's base temporary directory (pytest-N/, above each worker's popen-gwK/), so the first worker to ask
builds there under a file lock while any other waits, then reads the same files. A build that fails leaves no
completion marker: the next one starts again from an empty directory (and fails its own tests the same way)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

DONE = ".built"


def run_root(tmp_path_factory) -> Path:
    """The directory every worker of this test run shares (the plain base temporary directory without xdist)."""
    base = tmp_path_factory.getbasetemp()
    # an xdist worker's is <the run's>/popen-<worker id>; a pytest started by a test inherits PYTEST_XDIST_WORKER
    # but not that directory, and keeps its own
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return base.parent if worker and base.name == f"popen-{worker}" else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `name`, filled by `build(directory)` once in this test run."""
    d = run_root(tmp_path_factory) / name
    with FileLock(str(d) + ".lock"):
        if not (d / DONE).is_file():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            build(d)
            (d / DONE).write_text("ok")
    return d
