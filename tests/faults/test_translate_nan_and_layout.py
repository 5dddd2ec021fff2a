"""Stage 1 with non-finite losses and gradients on some ranks (2 ranks, torchrun): a bad step is skipped on every
rank (C and the Adam moments unchanged), counted, and the run stops with a clear message once more than
train.max_bad_steps steps were bad; C is never poisoned. Then its checkpoints are offered to runs with another
number of ranks (resumed: C is re-split) or another configuration (refused, with the reason)."""

from __future__ import annotations

import shutil

import pytest
import torch
from tests.helpers.faults_suite import Job, ledger, translate_args

from s2t2_dist.config import load_config
from s2t2_dist.stages.translate import TranslateConfig, run
from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.errors import CheckpointError

pytestmark = pytest.mark.faults

FAULTS = "nan_grad_at_step:3@1,inf_loss_at_step:5@0,nan_loss_at_step:6"


@pytest.fixture(scope="module")
def nan_run(tiny_data, stories, tmp_path_factory):
    root = tmp_path_factory.mktemp("nan")
    job = Job("translate.py", translate_args(tiny_data, stories, root / "run", "train.steps=8", "train.ckpt_every=1",
                                             "train.keep_checkpoints=20", "train.max_bad_steps=2"),
              trace=root / "trace", fault=FAULTS, log=root / "job.log")
    out = job.expect(rc_ok=False)
    return root / "run", out


def _engine_state(run_dir, step, rank):
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}" / f"engine_rank{rank:05d}.pt", weights_only=True)


def test_bad_steps_skipped_on_every_rank_then_the_run_stops(nan_run):
    run_dir, out = nan_run
    assert "TooManyBadSteps: 3 steps had non-finite loss or gradients (limit train.max_bad_steps=2); last at step 6" \
        in out, out[-3000:]
    assert Checkpointer(run_dir).complete_steps() == [1, 2, 3, 4, 5]  # nothing written for the failing step
    for r in (0, 1):  # a NaN gradient on rank 1 (step 3), an inf loss on rank 0 (step 5): skipped on BOTH ranks
        s = {k: _engine_state(run_dir, k, r) for k in (2, 3, 4, 5)}
        for a, b in ((2, 3), (4, 5)):
            assert torch.equal(s[a]["params"]["C"], s[b]["params"]["C"]), (r, a, b)
            assert s[a]["optimizer"]["state"] and all(
                torch.equal(s[a]["optimizer"]["state"][i][k], s[b]["optimizer"]["state"][i][k])
                for i in s[a]["optimizer"]["state"] for k in s[a]["optimizer"]["state"][i]), (r, a, b)
        assert not torch.equal(s[3]["params"]["C"], s[4]["params"]["C"])  # good steps do train
        assert all(torch.isfinite(s[k]["params"]["C"]).all() for k in s)
        loop = torch.load(run_dir / "checkpoints" / "step_00000005" / f"loop_rank{r:05d}.pt", weights_only=True)
        assert loop["bad_steps"] == 2
    ledger("translate: NaN gradient on one rank (skipped on both ranks, counted)")
    ledger("translate: inf loss on one rank (skipped on both ranks, counted)")
    ledger("translate: NaN loss on all ranks beyond train.max_bad_steps: clear stop", lost="nothing (stops; C finite)")


def test_a_nan_in_C_after_an_update_stops_every_rank_before_its_checkpoint(tiny_data, stories, tmp_path):
    """A step whose loss and gradient were finite but whose update broke C (one entry on rank 1 set to NaN after
    step 3): both ranks stop at that step with one line naming the cause, and step 3 is never checkpointed."""
    job = Job("translate.py", translate_args(tiny_data, stories, tmp_path / "run", "train.steps=6",
                                             "train.ckpt_every=1", "train.keep_checkpoints=20"),
              trace=tmp_path / "trace", fault="nan_param_at_step:3@1", log=tmp_path / "job.log")
    out = job.expect(rc_ok=False)
    assert "NonFiniteParameters: the trained parameters hold NaN or infinite values after step 3 (on 1 rank(s))" \
        in out, out[-3000:]
    assert "step_00000002" in out.split("NonFiniteParameters", 1)[1].splitlines()[0]
    assert Checkpointer(tmp_path / "run").complete_steps() == [1, 2]
    # both ranks stop at the same step with the same one line (torchrun's own report of the exit code follows)
    assert out.count("] s2t2 translate: error: NonFiniteParameters: ") == 2, out[-3000:]
    ledger("translate: an update that leaves C non-finite (loss and gradient finite)",
           lost="the one step (stops before checkpointing it)")


def _in_process(monkeypatch, *args):
    from s2t2_dist.utils.rundir import release_all

    monkeypatch.setenv("S2T2_DEVICE", "cpu")
    try:
        return run(load_config(TranslateConfig, None, list(args)))
    finally:  # a run that raised still holds run_dir's lock until its process ends (here: pytest's)
        release_all()


def test_checkpoint_of_two_ranks_resumed_by_one(nan_run, tiny_data, stories, monkeypatch, caplog):
    """Elastic: C's columns and Adam moments of the 2 ranks are reassembled for 1 (tests/stages/test_translate_elastic.py
    checks the arithmetic against an uninterrupted run)."""
    run_dir, _ = nan_run
    with caplog.at_level("WARNING", logger="s2t2.checkpoint"):
        summary = _in_process(monkeypatch, *translate_args(tiny_data, stories, run_dir, "train.steps=8"))
    assert summary["finished"] and summary["step"] == 8
    assert "step_00000005, written by 2 ranks, on 1 ranks" in caplog.text
    ledger("elastic: a checkpoint of 2 ranks resumed by 1 (C and its Adam moments re-split)")


def test_checkpoint_of_one_rank_resumed_by_two_and_other_config_refused(stage1_p, tiny_data, stories, monkeypatch,
                                                                         tmp_path):
    run_dir = tmp_path / "run"  # a copy of a 1-rank stage-1 run's checkpoint at step 2 (of train.steps=4)
    shutil.copytree(stage1_p.parent / "checkpoints", run_dir / "checkpoints")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # (train.steps cannot grow on resume)
    with pytest.raises(CheckpointError, match=r"belongs to another configuration \(translator: checkpoint="):
        _in_process(monkeypatch, *translate_args(tiny_data, stories, run_dir, "train.steps=4", "translator.n_iter=2"))
    ledger("bad input: a checkpoint of another configuration (refused)")
    job = Job("translate.py", translate_args(tiny_data, stories, run_dir, "train.steps=4"), log=tmp_path / "j.log")
    out = job.expect(rc_ok=True)
    assert "step_00000002, written by 1 ranks, on 2 ranks" in out
    ledger("elastic: a checkpoint of 1 rank resumed by 2 (C and its Adam moments re-split)")
