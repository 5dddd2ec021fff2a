"""Atomic writes and JSON-lines logs (s2t2_dist.utils.io): a crash never leaves a partial file under its final name."""

import json

import pytest

from s2t2_dist.utils.io import (
    AtomicFile, append_json_line, atomic_dir, atomic_open, atomic_write_json, json_sha256, load_json, read_json_lines,
    sha256_file, write_json_lines)


def test_atomic_file_commit_abort_and_stable_temp_name(tmp_path):
    final = tmp_path / "sub" / "a.bin"
    f = AtomicFile(final, "wb")
    assert f.tmp == tmp_path / "sub" / "a.bin.tmp" and f.tmp.exists() and not final.exists()
    f.file.write(b"abc")
    f.commit()
    assert final.read_bytes() == b"abc" and not f.tmp.exists()
    (tmp_path / "sub" / "a.bin.tmp").write_bytes(b"left over by a killed run")
    with pytest.raises(RuntimeError):
        with atomic_open(final, "w", encoding="utf-8") as fh:  # overwrites the leftover, then fails
            fh.write("new")
            raise RuntimeError("crash")
    assert final.read_bytes() == b"abc" and not (tmp_path / "sub" / "a.bin.tmp").exists()
    with pytest.raises(ValueError, match="mode"):
        AtomicFile(final, "ab")


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path):
    d = tmp_path / "tok"
    with atomic_dir(d) as tmp:
        (tmp / "x.json").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"] and (d / "x.json").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_dir(d) as tmp:
            (tmp / "y.json").write_text("2")
            raise RuntimeError("crash")
    assert sorted(p.name for p in d.iterdir()) == ["x.json"] and sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    with atomic_dir(d) as tmp:
        (tmp / "y.json").write_text("2")
    assert sorted(p.name for p in d.iterdir()) == ["y.json"] and sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_json_lines_log_ignores_a_torn_last_line(tmp_path):
    log = tmp_path / "journal.jsonl"
    assert read_json_lines(log) == []
    append_json_line(log, {"a": 1})
    append_json_line(log, {"b": 2})
    with open(log, "a") as f:
        f.write('{"c": 3')  # a crash mid-append
    assert read_json_lines(log) == [{"a": 1}, {"b": 2}]
    write_json_lines(log, [{"a": 1}])
    assert log.read_text() == '{"a": 1}\n'


def test_load_json_names_the_file_and_raises_the_callers_error(tmp_path):
    class MyError(Exception):
        pass

    p = tmp_path / "m.json"
    with pytest.raises(MyError, match=r"manifest not found: .*m\.json"):
        load_json(p, "manifest", MyError)
    p.write_text("{not json")
    with pytest.raises(MyError, match="not valid JSON .* the manifest is corrupt"):
        load_json(p, "manifest", MyError)
    atomic_write_json(p, {"x": [1, 2]})
    assert load_json(p) == {"x": [1, 2]} and json.loads(p.read_text()) == {"x": [1, 2]}
    assert json_sha256({"b": 1, "a": 2}) == json_sha256({"a": 2, "b": 1}) != json_sha256({"a": 2})
    assert len(sha256_file(p)) == 64
