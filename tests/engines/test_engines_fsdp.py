"""FSDP2Engine for real: 2 CPU processes under torchrun, the project's training loop, a tiny OLMo with untied
embeddings (like OLMo-7B), activation checkpointing, DCP checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.engines_launch import launch_torchrun, side_by_side

pytestmark = pytest.mark.slow

STEPS, STOP = 6, 3


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    common = ["--engine", "fsdp", "--steps", str(STEPS), "--tie", "0", "--act_ckpt"]
    # the uninterrupted run and the first part of the interrupted one are independent: side by side
    full, part = side_by_side(
        (launch_torchrun, [*common, "--run_dir", str(d / "full"), "--export", str(d / "export"), "--nan_check"],
         d / "out_full"),
        (launch_torchrun, [*common, "--run_dir", str(d / "resumed"), "--stop_after", str(STOP)], d / "out_part"))
    rest = launch_torchrun([*common, "--run_dir", str(d / "resumed")], d / "out_rest")
    return {"dir": d, "full": full, "part": part, "rest": rest}


def test_loss_falls_and_ranks_agree(fsdp):
    r0, r1 = fsdp["full"]
    losses = [l for _, l in r0["losses"]]
    assert len(losses) == STEPS and all(math.isfinite(l) for l in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert r0["losses"] == r1["losses"] and r0["bad_steps"] == 0 and r0["finished"]


def test_parameters_really_sharded(fsdp):
    for r in fsdp["full"]:
        assert r["total_numel"] > 100_000
        assert abs(r["local_numel"] - r["total_numel"] / 2) <= 0.02 * r["total_numel"], r


def test_resume_gives_the_same_curve(fsdp):
    part, rest, full = fsdp["part"][0], fsdp["rest"][0], fsdp["full"][0]
    assert part["preempted"] and part["step"] == STOP
    # the resumed run reports the whole curve (steps up to STOP from the checkpoint): bit-identical floats
    assert part["losses"] == full["losses"][:STOP] and rest["losses"] == full["losses"]
    assert part["lrs"] + rest["lrs"] == full["lrs"]
    last = sorted((fsdp["dir"] / "resumed" / "checkpoints").iterdir())[-1]
    assert (last / "fsdp" / ".metadata").is_file()


def test_non_finite_step_is_skipped_on_every_rank(fsdp):
    for r in fsdp["full"]:
        nc = r["nan_check"]
        assert nc["applied"] is False and not math.isfinite(nc["norm"])
        assert nc["sched_after"] == nc["sched_before"] + 1
        assert nc["applied2"] is True and math.isfinite(nc["norm2"])
    nc0 = fsdp["full"][0]["nan_check"]
    assert nc0["unchanged"] is True and nc0["changed2"] is True


def test_consolidated_export_loads_in_plain_transformers(fsdp):
    from transformers import AutoModelForCausalLM

    d = fsdp["dir"]
    ref = torch.load(d / "out_full" / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(d / "export", dtype=torch.float32).eval()
    assert type(model).__name__ == "OlmoForCausalLM" and not model.config.tie_word_embeddings
    with torch.no_grad():
        logits = model(input_ids=ref["probe"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def test_tied_embeddings_train_and_export(tmp_path):
    """OLMo-1B ties the embedding and the LM head: one shared parameter in the root FSDP unit."""
    from transformers import AutoModelForCausalLM

    rs = launch_torchrun(["--engine", "fsdp", "--steps", "3", "--tie", "1", "--run_dir", str(tmp_path / "run"),
                          "--export", str(tmp_path / "export")], tmp_path / "out")
    losses = [l for _, l in rs[0]["losses"]]
    assert len(losses) == 3 and losses[-1] < losses[0]
    ref = torch.load(tmp_path / "out" / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ref["probe"]).logits, ref["logits"], rtol=0, atol=1e-5)
