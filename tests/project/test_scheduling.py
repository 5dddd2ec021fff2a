"""The xdist scheduler of tests/conftest.py reads each module's marks from its text (xdist's controller collects
nothing): the `pytestmark = ...` line and `@pytest.mark.NAME` decorators count, a mention in a comment or a string
does not (before: any mention moved a module onto the SLURM worker)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# a copy of its own, by path: the tests below patch its REPO, which the live tests.conftest must keep
_spec = importlib.util.spec_from_file_location("s2t2_tests_conftest", Path(__file__).parents[1] / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_marks_come_from_pytestmark_and_decorators_only(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "REPO", tmp_path)
    conftest._marks.cache_clear()
    (tmp_path / "a.py").write_text("import pytest\npytestmark = [pytest.mark.faults, pytest.mark.slurm]\n")
    (tmp_path / "b.py").write_text("import pytest\n\n\n@pytest.mark.slow  # pytest.mark.slurm in a comment\n"
                                   "def test_x():\n    pass\n")
    (tmp_path / "c.py").write_text('"""Not marked: pytest.mark.slurm in a docstring."""\n# pytest.mark.slow\n'
                                   'X = "pytest.mark.faults"\n')
    try:
        assert conftest._starts_a_slurm_cluster("a.py") and conftest._runs_long("a.py")
        assert not conftest._starts_a_slurm_cluster("b.py") and conftest._runs_long("b.py")
        assert not conftest._starts_a_slurm_cluster("c.py") and not conftest._runs_long("c.py")
        assert conftest._marks("missing.py") == frozenset()
    finally:
        conftest._marks.cache_clear()


def test_the_suite_has_its_slurm_modules_on_one_worker():
    conftest._marks.cache_clear()
    slurm = sorted(p.relative_to(conftest.REPO).as_posix() for p in (conftest.REPO / "tests").rglob("test_*.py")
                   if conftest._starts_a_slurm_cluster(p.relative_to(conftest.REPO).as_posix()))
    assert slurm == ["tests/cluster/test_slurm_cluster.py", "tests/faults/test_slurm_requeue_faults.py"]
