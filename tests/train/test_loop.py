import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.errors import CheckpointError
from s2t2_dist.train.loop import train
from s2t2_dist.errors import TooManyBadSteps
from s2t2_dist.train.metrics import MetricsLogger
from tests.helpers.toy import make


def _run(run_dir, steps=12, overrides=(), poison=()):
    tcfg, task, engine, loader = make(steps, overrides, poison)
    log = MetricsLogger(run_dir / "tb", rank=0, node_rank=0, local_rank=0)
    res = train(tcfg, task, engine, loader, Checkpointer(run_dir, keep=2, fingerprint={"cfg": "a"}), log,
                progress=False)
    log.close()
    return res, task, loader


def test_loss_falls_and_tensorboard_series(tmp_path):
    res, task, _ = _run(tmp_path)
    assert res.finished and res.step == 12
    losses = [l for _, l in res.losses]
    assert sum(losses[-3:]) < 0.3 * sum(losses[:3])
    acc = EventAccumulator(str(tmp_path / "tb" / "global"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for t in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "w_norm"):
        assert t in tags
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12]
    node = EventAccumulator(str(tmp_path / "tb" / "node_000"))
    node.Reload()
    assert "node/step_time_s" in node.Tags()["scalars"]
    # only the last 2 complete checkpoints are kept
    assert Checkpointer(tmp_path).complete_steps() == [9, 12]


def test_stop_and_resume_gives_identical_curve(tmp_path):
    ref, ref_task, _ = _run(tmp_path / "ref")
    a, _, loader_a = _run(tmp_path / "split", overrides=["stop_after=5"])
    assert a.preempted and not a.finished and a.step == 5
    b, task_b, loader_b = _run(tmp_path / "split")
    assert b.finished
    assert [s for s, _ in a.losses] == list(range(1, 6))
    # the resumed run reports the whole curve (the checkpoint carries the steps before it), bit-identical to the
    # uninterrupted run: same data order, same RNG, same optimiser state
    assert b.losses == ref.losses
    # the data position resumed exactly: nothing repeated, nothing skipped
    assert loader_a.seen + loader_b.seen == _run(tmp_path / "ref2")[2].seen


def test_partial_checkpoint_is_never_loaded(tmp_path):
    _run(tmp_path, overrides=["stop_after=3"])
    ck = Checkpointer(tmp_path)
    assert ck.complete_steps() == [3]
    # a crash in the middle of writing step 6 leaves a .partial dir (and a dir without meta.json)
    (tmp_path / "checkpoints" / "step_00000006.partial").mkdir()
    (tmp_path / "checkpoints" / "step_00000009").mkdir()
    assert ck.latest().name == "step_00000003"
    res, _, loader = _run(tmp_path)
    # resumed from step 3: the data of steps 4-12 only, and the whole curve in the result
    full = _run(tmp_path / "ref")[2].seen
    assert len(loader.seen) == len(full) * 9 // 12 and loader.seen == full[-len(loader.seen):]
    assert [s for s, _ in res.losses] == list(range(1, 13))


def test_failed_checkpoint_write_keeps_previous(tmp_path, monkeypatch):
    _run(tmp_path, overrides=["stop_after=3"])
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        if "loop_rank" in str(f):
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        _run(tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    ck = Checkpointer(tmp_path)
    assert ck.complete_steps() == [3]
    assert not list((tmp_path / "checkpoints").glob("*.partial"))


def test_checkpoint_of_other_config_refused(tmp_path):
    _run(tmp_path, overrides=["stop_after=3"])
    tcfg, task, engine, loader = make()
    log = MetricsLogger(tmp_path / "tb2", 0, 0, 0, enabled=False)
    with pytest.raises(CheckpointError, match=r"another configuration \(cfg: checkpoint='a' run='b'\)"):
        train(tcfg, task, engine, loader, Checkpointer(tmp_path, fingerprint={"cfg": "b"}), log, progress=False)


def test_nonfinite_steps_skipped_then_stop(tmp_path):
    # micro-batch calls 3 and 4 are step 2's two micro-batches: that step is skipped, the weights stay finite
    res, task, _ = _run(tmp_path / "a", poison=(3,))
    assert res.finished and res.bad_steps == 1
    assert torch.isfinite(task.model.weight).all()
    with pytest.raises(TooManyBadSteps, match="max_bad_steps=1"):
        _run(tmp_path / "b", overrides=["max_bad_steps=1"], poison=(1, 3, 5))


def test_sigterm_checkpoints_and_stops(tmp_path):
    import signal

    tcfg, task, engine, loader = make(12)
    log = MetricsLogger(tmp_path / "tb", 0, 0, 0)

    def on_step(step, loss):
        if step == 4:
            os.kill(os.getpid(), signal.SIGUSR1)

    res = train(tcfg, task, engine, loader, Checkpointer(tmp_path), log, progress=False, on_step=on_step)
    assert res.preempted and res.step == 4
    assert Checkpointer(tmp_path).complete_steps()[-1] == 4


@pytest.mark.parametrize("every,passes,logged", [(4, 3, [4, 8, 12]), (5, 3, [5, 10, 12]), (0, 1, [12])])
def test_final_evaluation_reuses_the_periodic_one_at_the_last_step(tmp_path, every, passes, logged):
    """A run whose train.eval_every divides its steps scores the held-out documents once at the last step, not
    twice; otherwise the end adds its own pass. Both are logged under eval/ at their steps."""
    from s2t2_dist.train.callbacks import final_evaluation

    tcfg, task, engine, loader = make(12, [f"eval_every={every}"])
    seen = []

    def evaluate():
        seen.append(float(task.model.weight.detach().norm()))
        return {"bpb": 1.0 / len(seen)}

    task.evaluate = evaluate
    log = MetricsLogger(tmp_path / "tb", rank=0, node_rank=0, local_rank=0)
    res = train(tcfg, task, engine, loader, Checkpointer(tmp_path, keep=2, fingerprint={"cfg": "a"}), log,
                progress=False)
    metrics = final_evaluation(res, task, engine, log)
    log.close()
    assert res.finished and len(seen) == passes
    assert metrics == {"bpb": 1.0 / passes}  # the last pass's, at the final weights
    acc = EventAccumulator(str(tmp_path / "tb" / "global"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/bpb")] == logged
