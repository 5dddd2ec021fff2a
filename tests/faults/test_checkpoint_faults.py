"""Damaged checkpoints, on the shared loop with the toy task (exact, fast): a truncated or garbled file in the newest
checkpoint sets it aside and resumes from the one before, ending exactly where an uninterrupted run ends; a prune
cut short never looks complete; a checkpoint that would run code when unpickled is refused and the code never runs."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from tests.helpers.faults_suite import ledger

from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.errors import CheckpointError
from s2t2_dist.train.loop import train
from s2t2_dist.train.metrics import MetricsLogger
from tests.helpers.toy import make

pytestmark = pytest.mark.faults


def _run(run_dir, steps=12, overrides=()):
    tcfg, task, engine, loader = make(steps, overrides)
    log = MetricsLogger(run_dir / "tb", rank=0, node_rank=0, local_rank=0, enabled=False)
    res = train(tcfg, task, engine, loader, Checkpointer(run_dir, keep=3, fingerprint={"cfg": "a"}), log,
                progress=False)
    return res, task, loader


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    res, task, loader = _run(tmp_path_factory.mktemp("ref"))
    return res.losses, task.model.weight.detach().clone(), loader.seen


def _resume_after_damage(tmp_path, damage, reference):
    """Run to step 9 (checkpoints 3, 6, 9), damage checkpoint 9, finish: resumes from 6, ends like the reference."""
    first, _, loader_a = _run(tmp_path, overrides=["stop_after=9"])
    ck = tmp_path / "checkpoints"
    damage(ck / "step_00000009")
    res, task, loader_b = _run(tmp_path)
    assert res.finished and (ck / "step_00000009.corrupt").is_dir()  # set aside for inspection, not deleted
    ref_losses, ref_w, ref_seen = reference
    # resumed from checkpoint 6: its curve up to step 6, steps 7-12 taken again, the whole curve as the reference's
    assert first.losses[:6] == ref_losses[:6] and res.losses == ref_losses
    assert torch.equal(task.model.weight.detach(), ref_w)
    # the data position came from checkpoint 6: the samples of steps 7-9 are trained on again, once
    assert loader_a.seen[:12] + loader_b.seen == ref_seen
    return res


def test_truncated_engine_file_falls_back_to_previous_checkpoint(tmp_path, reference, caplog):
    def truncate(d):
        f = d / "engine_rank00000.pt"
        f.write_bytes(f.read_bytes()[:100])

    with caplog.at_level("ERROR", logger="s2t2.checkpoint"):
        _resume_after_damage(tmp_path, truncate, reference)
    assert "engine_rank00000.pt has 100 bytes" in caplog.text
    assert "trying the one before it, checkpoints/step_00000006" in caplog.text
    ledger("checkpoint: engine file truncated after the checkpoint completed")


def test_garbled_loop_state_falls_back_to_previous_checkpoint(tmp_path, reference, caplog):
    def garble(d):
        f = d / "loop_rank00000.pt"
        n = f.stat().st_size
        f.write_bytes(os.urandom(n))  # same size: only reading it can tell

    with caplog.at_level("ERROR", logger="s2t2.checkpoint"):
        _resume_after_damage(tmp_path, garble, reference)
    assert "loop_rank00000.pt is unreadable" in caplog.text
    ledger("checkpoint: loop state file overwritten with garbage (same size)")


def test_fallback_to_an_older_checkpoint_or_to_step_0_is_said(tmp_path, caplog):
    """Both checkpoints damaged: the log once said it resumed from the one before, then started at step 0
    without a word. Now each fallback says where it goes, and a start from step 0 says so."""
    _run(tmp_path, overrides=["stop_after=6"])  # checkpoints 3 and 6
    for s in (3, 6):
        f = tmp_path / "checkpoints" / f"step_{s:08d}" / "engine_rank00000.pt"
        f.write_bytes(f.read_bytes()[:100])
    with caplog.at_level("WARNING", logger="s2t2.checkpoint"):
        res, _, loader = _run(tmp_path)
    assert res.finished and len(loader.seen) == len(_run(tmp_path / "ref")[2].seen)  # from scratch: every batch
    assert "trying the one before it, checkpoints/step_00000003" in caplog.text
    assert "no checkpoint is left: the run starts from step 0" in caplog.text
    assert "every checkpoint in" in caplog.text and "starting from step 0, not resuming" in caplog.text


def test_deleted_file_falls_back_to_previous_checkpoint(tmp_path, reference):
    _resume_after_damage(tmp_path, lambda d: (d / "engine_rank00000.pt").unlink(), reference)
    ledger("checkpoint: a file of the newest checkpoint deleted")


def test_prune_cut_short_never_looks_complete(tmp_path):
    _run(tmp_path, overrides=["stop_after=9"])
    ck = Checkpointer(tmp_path, keep=1)
    # a prune killed after removing meta.json: the directory is not complete, so never a resume candidate
    (tmp_path / "checkpoints" / "step_00000003" / "meta.json").unlink()
    assert ck.complete_steps() == [6, 9]
    ck._prune()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000009"]


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['S2T2_EVIL_MARK']}",))


def test_checkpoint_that_would_run_code_is_refused(tmp_path, reference, monkeypatch):
    mark = tmp_path / "code_ran"
    monkeypatch.setenv("S2T2_EVIL_MARK", str(mark))

    def plant(d):
        f = d / "loop_rank00000.pt"
        torch.save({"step": 9, "x": _Evil()}, f)  # a legal torch file whose unpickling calls os.system
        meta = json.loads((d / "meta.json").read_text())
        meta["files"]["loop_rank00000.pt"] = f.stat().st_size  # sizes match: only the unpickler can tell
        (d / "meta.json").write_text(json.dumps(meta))

    _resume_after_damage(tmp_path, plant, reference)
    assert not mark.exists(), "unpickling a checkpoint ran code"
    # the same in the engine's own file: refused with the file named, and the code does not run
    _run(tmp_path / "b", overrides=["stop_after=3"])
    eng = tmp_path / "b" / "checkpoints" / "step_00000003" / "engine_rank00000.pt"
    with open(eng, "wb") as f:
        pickle.dump(_Evil(), f)
    meta_f = eng.parent / "meta.json"
    meta = json.loads(meta_f.read_text())
    meta["files"]["engine_rank00000.pt"] = eng.stat().st_size
    meta_f.write_text(json.dumps(meta))
    tcfg, task, engine, loader = make(12)
    with pytest.raises(RuntimeError, match=r"engine_rank00000.pt is unreadable \(UnpicklingError"):
        Checkpointer(tmp_path / "b").load(eng.parent, engine)
    assert not mark.exists(), "unpickling a checkpoint ran code"
    ledger("checkpoint: pickled code planted in a checkpoint (refused, not run)", count=2)


def test_checkpoint_of_other_config_or_rank_count_is_refused_not_skipped(tmp_path):
    _run(tmp_path, overrides=["stop_after=3"])
    tcfg, task, engine, loader = make()
    log = MetricsLogger(tmp_path / "tb2", 0, 0, 0, enabled=False)
    with pytest.raises(CheckpointError, match=r"another configuration \(cfg: checkpoint='a' run='b'\)"):
        train(tcfg, task, engine, loader, Checkpointer(tmp_path, fingerprint={"cfg": "b"}), log, progress=False)
    meta_f = tmp_path / "checkpoints" / "step_00000003" / "meta.json"
    meta_f.write_text(json.dumps({**json.loads(meta_f.read_text()), "world_size": 2}))
    with pytest.raises(CheckpointError, match="written by 2 ranks but this run has 1"):
        train(tcfg, task, engine, loader, Checkpointer(tmp_path, fingerprint={"cfg": "a"}), log, progress=False)
    assert Checkpointer(tmp_path).complete_steps() == [3]  # refused, not set aside
