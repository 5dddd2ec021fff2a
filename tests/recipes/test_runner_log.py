import sys

import pytest

from s2t2_dist.recipes.orchestrate import Runner, StageFailed


def test_a_rerun_appends_to_the_jobs_log_and_keeps_the_failed_attempt(tmp_path):
    r = Runner(ranks=1, in_process=False, log_dir=tmp_path, echo=False)
    fail = [sys.executable, "-c", "import sys; print('first attempt: out of memory'); sys.exit(3)"]
    with pytest.raises(StageFailed, match="out of memory"):
        r._subprocess(fail, "job", "fail-cmd")
    log = r._subprocess([sys.executable, "-c", "print('second attempt: done')"], "job", "ok-cmd")
    text = log.read_text()
    assert text.startswith("$ fail-cmd\nfirst attempt: out of memory\n")
    assert "--- rerun at " in text and text.index("first attempt") < text.index("$ ok-cmd") < text.index("second attempt")


def test_a_finished_run_is_reused_only_while_what_it_read_was_made_the_same_way(tmp_path, monkeypatch):
    """Runner.run's `inputs` (how the files a job reads were made) are part of the run's identity: the same argv
    over an input made another way (a P file rewritten by a longer run, at the same path) starts afresh."""
    r = Runner(ranks=1, in_process=False, log_dir=tmp_path / "logs", echo=False)
    count, rd = tmp_path / "count", tmp_path / "run"
    script = (f"import json, pathlib; c = pathlib.Path({str(count)!r}); c.write_text(str(int(c.read_text() or 0) + 1)"
              f" if c.exists() else '1'); pathlib.Path({str(rd / 'result.json')!r}).write_text("
              "json.dumps({'finished': True}))")
    monkeypatch.setattr(r, "command", lambda stage, argv: [sys.executable, "-c", script])
    runs = [r.run("evaluate", ["x=1"], rd, "job", result_file=rd / "result.json", inputs=ins).reused
            for ins in (["P at 200 steps"], ["P at 200 steps"], ["P at 600 steps"], None)]
    assert runs == [False, True, False, False] and count.read_text() == "3"


def test_a_copied_output_directory_reuses_its_finished_runs_and_restarts_the_unfinished(tmp_path, monkeypatch):
    """A run is identified by its arguments relative to the output directory (`root`): the finished run of a copied
    `--out` is reused there; an unfinished one starts afresh (its checkpoints name the old paths)."""
    import json
    import shutil

    count = tmp_path / "count"

    def runner(root):
        r = Runner(ranks=1, in_process=False, log_dir=root / "logs", echo=False, root=root)
        script = (f"import json, pathlib, sys; c = pathlib.Path({str(count)!r}); c.write_text(str(int(c.read_text())"
                  " + 1) if c.exists() else '1'); rd = pathlib.Path(sys.argv[1].split('=', 1)[1]); "
                  "(rd / 'ckpt').write_text('x'); (rd / 'result.json').write_text(json.dumps({'finished': True}))")
        monkeypatch.setattr(r, "command", lambda stage, argv: [sys.executable, "-c", script, *argv])
        return r

    def run(root, name):
        rd = root / "runs" / name
        return runner(root).run("evaluate", [f"run_dir={rd}", f"data.eval={root / 'data'}"], rd, name,
                                result_file=rd / "result.json")

    a, b = tmp_path / "a", tmp_path / "b"
    assert not run(a, "done").reused and not run(a, "cut").reused and count.read_text() == "2"
    (a / "runs" / "cut" / "result.json").write_text(json.dumps({"finished": False}))  # as if stopped mid-way
    (a / "runs" / "cut" / "step_3").write_text("a checkpoint of the old paths")
    shutil.copytree(a, b)
    assert run(b, "done").reused and count.read_text() == "2"  # the copy's finished run: reused, nothing ran
    again = run(b, "cut")
    assert not again.reused and count.read_text() == "3" and not (b / "runs" / "cut" / "step_3").exists()
    assert run(b, "cut").reused and run(a, "done").reused  # and the original still reuses its own
