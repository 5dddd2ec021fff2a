"""utils/stop.py's word to the launcher: the finished-run marker in S2T2_STEP_REPORT_DIR, written by rank 0 only."""
from __future__ import annotations

from s2t2_dist.utils import stop


def test_only_the_main_rank_marks_a_finished_step(tmp_path, monkeypatch):
    report = tmp_path / "step_report"
    monkeypatch.setenv("S2T2_STEP_REPORT_DIR", str(report))
    stop.tell_launcher(False)
    assert not report.exists()  # another rank never writes: one writer per job step
    stop.tell_launcher(True)
    assert (report / stop.FINISHED).read_text() == "finished\n"


def test_without_a_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("S2T2_STEP_REPORT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    stop.tell_launcher(True)
    assert list(tmp_path.iterdir()) == []
