"""A disk that fills during a checkpoint or a shard write: a clear error that says the disk is full, the previous
checkpoint (or the shards already written) stay valid, and after space is freed the same command continues to
exactly the result of a run that never hit the full disk.

Real full disks: a small tmpfs mounted for the test and filled to the last byte at the moment of the write (skipped
where mounting is not allowed). Injected ENOSPC (S2T2_FAULT=enospc_in_shard / enospc_in_checkpoint): always; the
2-rank checkpoint case is in test_translate_faults.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from tests.helpers.faults_suite import ledger, prepare_tiny, translate_args, write_tiny_fasta

from s2t2_dist.config import load_config
from s2t2_dist.data.shards import ShardFile
from s2t2_dist.engines.torch_engine import TorchEngine
from s2t2_dist.translator.pfile import load_p
from s2t2_dist.stages.translate import TranslateConfig, run
from s2t2_dist import faults
from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.errors import CheckpointError

pytestmark = pytest.mark.faults


@pytest.fixture
def tmpfs(tmp_path):
    d = tmp_path / "small_disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected-ENOSPC tests cover this path")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(disk) -> None:
    """Leave no free byte on `disk`."""
    with open(disk / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    assert shutil.disk_usage(disk).free < 4096


def _shard_summary(d):
    m = json.loads((d / "manifest.json").read_text())
    return m["totals"], [(s["name"], s["n_samples"], s["sha256"]) for s in m["shards"]]


def _check_resumed_prepare(out, tiny_data):
    for split in ("train", "eval"):
        assert _shard_summary(out / "shards/new" / split) == _shard_summary(tiny_data / "shards/new" / split)


def test_disk_fills_while_writing_a_shard(tmp_path, tmpfs, monkeypatch, tiny_data):
    fasta = write_tiny_fasta(tmp_path / "tiny.fasta")
    out = tmpfs / "data"
    real_commit = ShardFile.commit
    filled = []

    def commit(self):
        if self.path.name == "train-000002.tar" and not filled:
            filled.append(fill(tmpfs))
        return real_commit(self)

    monkeypatch.setattr(ShardFile, "commit", commit)
    with pytest.raises(OSError) as ei:
        prepare_tiny(out, fasta)
    msg = str(ei.value)
    assert "train-000002.tar failed" in msg and "the disk is full" in msg and "2 shards written before it" in msg, msg
    train = out / "shards/new/train"
    assert sorted(p.name for p in train.iterdir() if p.suffix == ".tar") == ["train-000000.tar", "train-000001.tar"]
    assert not list(train.glob("*.tmp"))  # the half-written shard was removed
    (tmpfs / "filler").unlink()
    prepare_tiny(out, fasta)  # the same command continues after the 2 complete shards
    _check_resumed_prepare(out, tiny_data)
    ledger("shards: the disk fills while a shard is written (real tmpfs)")


def test_injected_enospc_while_writing_a_shard(tmp_path, monkeypatch, tiny_data):
    fasta = write_tiny_fasta(tmp_path / "tiny.fasta")
    out = tmp_path / "data"
    monkeypatch.setenv(faults.ENV, "enospc_in_shard:3")
    with pytest.raises(OSError, match=r"train-000003.tar failed: No space left on device .* the disk is full"):
        prepare_tiny(out, fasta)
    monkeypatch.delenv(faults.ENV)
    prepare_tiny(out, fasta)
    _check_resumed_prepare(out, tiny_data)
    ledger("shards: ENOSPC while a shard is written (injected)")


def _translate(data, model, run_dir, trace, monkeypatch, *extra):
    monkeypatch.setenv(faults.TRACE_ENV, str(trace))
    cfg = load_config(TranslateConfig, None, translate_args(data, model, run_dir, "train.steps=8", *extra))
    return run(cfg)


def test_disk_fills_while_writing_a_checkpoint(tmp_path, tmpfs, monkeypatch, tiny_data, stories):
    monkeypatch.setenv("S2T2_DEVICE", "cpu")
    ref = _translate(tiny_data, stories, tmp_path / "ref", tmp_path / "ref_trace", monkeypatch)
    run_dir, trace = tmpfs / "run", tmp_path / "trace"
    real_save = TorchEngine.save
    filled = []

    def save(self, directory):
        if directory.name == "step_00000004.partial" and not filled:
            filled.append(fill(tmpfs))
        return real_save(self, directory)

    monkeypatch.setattr(TorchEngine, "save", save)
    with pytest.raises(CheckpointError) as ei:
        _translate(tiny_data, stories, run_dir, trace, monkeypatch)
    msg = str(ei.value)
    assert "step_00000004.partial failed" in msg and "the disk is full" in msg, msg
    assert "the previous checkpoint step_00000002 is kept and still valid" in msg, msg
    assert Checkpointer(run_dir).complete_steps() == [2]
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    (tmpfs / "filler").unlink()
    summary = _translate(tiny_data, stories, run_dir, trace, monkeypatch)
    assert summary["finished"] and summary["final_loss"] == ref["final_loss"]
    a = faults.effective_history(faults.read_trace(tmp_path / "ref_trace", 0))
    b = faults.effective_history(faults.read_trace(trace, 0))
    assert b["starts"][-1][1] == 2 and a["losses"] == b["losses"] and a["batches"] == b["batches"]
    pa, pb = load_p(ref["p_file"]), load_p(summary["p_file"])
    assert pa.indices.equal(pb.indices) and pa.values.equal(pb.values)
    ledger("checkpoint: the disk fills while a checkpoint is written (real tmpfs)")
