"""Stage 2 for real: 2 CPU processes through the real launchers, on real protein shards.

- `deepspeed --num_gpus 2 launch/finetune.py --ds_config configs/ds_zero3.json ...`: ZeRO-3, a tiny OLMo-1B-config
  model initialised from a P file;
- `torchrun --nproc_per_node 2 launch/finetune.py --config configs/finetune_olmo7b.yaml engine.kind=fsdp ...`:
  FSDP2, the transfer case: a P "learned" on the width-32 model applied to a width-48 OLMo-7B-config model (untied,
  activation checkpointing, as the 7B config says).

For each: an uninterrupted run of 6 steps, and a run stopped after 3 steps (train.stop_after) then resumed; periodic
and final held-out evaluation; the export checked with plain transformers in a clean process. Plus the evaluation
stage under ZeRO-3 (`deepspeed launch/evaluate.py ... configs/evaluate_transfer_7b.yaml`, transfer without
finetuning). The four first runs start together, then the two resumptions and the evaluation (on 2 cores the
launchers' start-up overlaps)."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.finetune_fixtures import (  # noqa: F401 - the session fixtures
    CTX, NEW_VOCAB, check_export_plain, deepspeed, torchrun, world)
from s2t2_dist.config import load_config
from s2t2_dist.stages.evaluate import EvaluateConfig, run as evaluate

pytestmark = pytest.mark.slow

STEPS, STOP = 6, 3


def _common(world, run_dir, model, **kw):
    args = [f"run_dir={run_dir}", f"model.path={model}", f"data.train={world.new_train}",
            f"data.eval={world.new_eval}", f"data.tokenizer={world.tokenizer}", "data.num_workers=0",
            f"init.p_file={world.p_a}", f"train.steps={STEPS}", "train.batch_size=4", "train.micro_batch_size=1",
            f"train.context_len={CTX}", "train.log_every=1", "train.eval_every=3", "train.eval_max_docs=0",
            "train.ckpt_every=0", "optim.lr=1e-2", "eval.batch_size=4"]
    return args + [f"{k}={v}" for k, v in kw.items()]


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    d = tmp_path_factory.mktemp("ft_launch")
    ds = ["--ds_config", "configs/ds_zero3.json",
          "engine.ds_overrides.zero_optimization.stage3_param_persistence_threshold=0"]
    fsdp = ["--config", "configs/finetune_olmo7b.yaml", "engine.kind=fsdp"]

    def ds_run(name, **kw):
        return deepspeed("launch/finetune.py", [*ds, *_common(world, d / name, world.model_a, **kw)], d / f"{name}.log")

    def fsdp_run(name, **kw):
        return torchrun("launch/finetune.py", [*fsdp, *_common(world, d / name, world.model_b, **kw)],
                        d / f"{name}.log")

    first = [ds_run("ds_full"), ds_run("ds_resumed", **{"train.stop_after": STOP}),
             fsdp_run("fsdp_full"), fsdp_run("fsdp_resumed", **{"train.stop_after": STOP})]
    part = {}
    for launch in first:
        launch.wait()
    for name in ("ds_resumed", "fsdp_resumed"):
        part[name] = json.loads((d / name / "result.json").read_text())
    # evaluation (c), transfer without finetuning, ZeRO-3 through the deepspeed launcher and the shipped config
    ev = deepspeed("launch/evaluate.py", [
        "--ds_config", "configs/ds_zero3.json", "--config", "configs/evaluate_transfer_7b.yaml", f"run_dir={d / 'ev'}",
        "output=", f"model.path={world.model_b}", f"data.eval={world.new_eval}", f"data.tokenizer={world.tokenizer}",
        f"init.p_file={world.p_a}", f"eval.context_len={CTX}", "eval.max_docs=0", "eval.batch_size=5"], d / "ev.log")
    second = [ds_run("ds_resumed"), fsdp_run("fsdp_resumed"), ev]
    for launch in second:
        launch.wait()
    out = {"dir": d}
    for name in ("ds_full", "ds_resumed", "fsdp_full", "fsdp_resumed"):
        out[name] = json.loads((d / name / "result.json").read_text())
    out["part"] = part
    out["ev"] = json.loads((d / "ev" / "eval.json").read_text())
    return out


@pytest.mark.parametrize("eng", ["ds", "fsdp"])
def test_loss_falls(runs, eng):
    r = runs[f"{eng}_full"]
    losses = [l for _, l in r["losses"]]
    assert r["finished"] and r["bad_steps"] == 0 and len(losses) == STEPS
    assert all(math.isfinite(l) for l in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    assert r["world_size"] == 2 and r["engine"] == ("deepspeed" if eng == "ds" else "fsdp")
    assert r["init"]["kind"] == "translated" and r["init"]["vocab_size"] == NEW_VOCAB


@pytest.mark.parametrize("eng", ["ds", "fsdp"])
def test_stop_and_resume_gives_the_same_loss_curve(runs, eng):
    part, rest, full = runs["part"][f"{eng}_resumed"], runs[f"{eng}_resumed"], runs[f"{eng}_full"]
    assert part["preempted"] and not part["finished"] and part["step"] == STOP
    # the resumed run reports the whole curve (steps up to STOP from the checkpoint): bit-identical floats
    assert part["losses"] == full["losses"][:STOP] and rest["losses"] == full["losses"]
    assert rest["eval"] == full["eval"]
    ckpt = runs["dir"] / f"{eng}_resumed" / "checkpoints"
    assert sorted(c.name for c in ckpt.iterdir()) == ["step_00000003", "step_00000006"]
    own = "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt" if eng == "ds" else "fsdp/.metadata"
    assert (ckpt / "step_00000006" / own).is_file()  # the engine's own sharded checkpoint inside the loop's


@pytest.mark.parametrize("eng", ["ds", "fsdp"])
def test_export_loads_and_generates_with_plain_transformers(runs, eng):
    d = runs["dir"] / f"{eng}_full"
    res = check_export_plain(d / "final", d / "export_probe.pt")
    assert res["s2t2_modules"] == []
    assert res["diff"] < 1e-5, res  # the export computes what the trained (sharded) model computed
    assert res["vocab"] == NEW_VOCAB and res["tied"] is False and res["model"] == "OlmoForCausalLM"
    assert res["prompt_ids"][0] == 0 and 1 <= res["new_tokens"] <= 6  # BOS of the new tokenizer; generate ran
    assert res["text"].startswith("MKTAYIAKQRQISFVKSHFSRQ")


@pytest.mark.parametrize("eng", ["ds", "fsdp"])
def test_distributed_eval_equals_single_process_eval_of_the_export(runs, world, eng, tmp_path):
    """The 2-rank evaluation (uneven shares, lock-step forwards under ZeRO-3 / FSDP2) sums exactly: the final
    metrics equal a 1-process evaluation of the exported model."""
    d = runs["dir"] / f"{eng}_full"
    cfg = load_config(EvaluateConfig, None, [f"run_dir={tmp_path}", f"model.path={d / 'final'}",
                                             f"data.eval={world.new_eval}", f"eval.context_len={CTX}",
                                             "eval.batch_size=3"])
    single = evaluate(cfg)["metrics"]
    dist_m = runs[f"{eng}_full"]["eval"]
    assert dist_m["docs"] == single["docs"] == 29
    assert (dist_m["tokens"], dist_m["bytes"]) == (single["tokens"], single["bytes"])
    assert dist_m["bpb"] == pytest.approx(single["bpb"], rel=1e-6)
    assert dist_m["bpb"] < dist_m["random_guess_bpb"]
    export_info = json.loads((d / "final" / "s2t2_export.json").read_text())
    assert export_info["step"] == STEPS and export_info["eval"] == dist_m


def test_sharded_transfer_evaluation_equals_single_process(runs, world, tmp_path):
    """`deepspeed launch/evaluate.py --ds_config configs/ds_zero3.json --config configs/evaluate_transfer_7b.yaml`:
    model B (ZeRO-3 partitions, 2 ranks) with the P of model A, no finetuning, equals the same evaluation in one
    plain process."""
    ev = runs["ev"]
    assert ev["world_size"] == 2 and ev["engine"] == "deepspeed" and ev["name"] == "s2t2_transfer_1b_to_7b"
    cfg = load_config(EvaluateConfig, None, [f"run_dir={tmp_path}", f"model.path={world.model_b}",
                                             "init.kind=translated", f"init.p_file={world.p_a}",
                                             f"data.tokenizer={world.tokenizer}", f"data.eval={world.new_eval}",
                                             f"eval.context_len={CTX}"])
    single = evaluate(cfg)["metrics"]
    assert ev["metrics"]["docs"] == single["docs"] == 29
    assert ev["metrics"]["bpb"] == pytest.approx(single["bpb"], rel=1e-6)
    assert math.isfinite(ev["metrics"]["perplexity"])
    assert ev["metrics"]["random_guess_bpb"] == pytest.approx(single["random_guess_bpb"])


def test_tensorboard_has_train_and_eval_series(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["dir"] / "ds_full" / "tb" / "global"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in acc.Scalars("eval/bpb")] == [3, 6]
