"""`s2t2 demo` end to end, as a newcomer runs it: `python launch/demo.py --out DIR` (2 gloo ranks by default), then
its outputs: results with finite metrics, the exported Hugging Face model loading with plain transformers, the
TensorBoard logs of both stages, the report."""

import json
import math
import sys

import pytest
import torch

from s2t2_dist.recipes.orchestrate import tb_scalars
from tests.helpers.stage_fixtures import REPO, run_cmd

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    # fewer steps than the default 300 (CI time): the same code path, a shorter run
    proc = run_cmd([sys.executable, str(REPO / "launch" / "demo.py"), "--out", str(out), "--steps", "60"], timeout=900)
    return out, proc.stdout + proc.stderr


def test_demo_prints_where_everything_is(demo):
    out, text = demo
    for phase in ("[1/6] prepare", "[2/6] source LM", "[3/6] translate", "[4/6] finetune", "[5/6] evaluate",
                  "[6/6] report"):
        assert phase in text, phase
    assert f"tensorboard --logdir {out / 'runs'}" in text
    assert str(out / "report.md") in text and str(out / "results.json") in text and str(out / "model") in text
    assert "2 ranks (torchrun" in text
    assert "mean largest weight per column of W = P/nu" in text and "learned translations" in text


def test_demo_results_are_finite_and_ranked_against_random_guess(demo):
    out, _ = demo
    r = json.loads((out / "results.json").read_text())
    assert r["ranks"] == 2 and r["source"] == "stories260k"
    u = r["translate"]["P"]["u"]
    assert u == 512 and r["translate"]["P"]["v"] == 512  # the stories260K vocabulary -> the protein BPE
    for section in ("translate", "finetune"):
        ev = r[section]["eval"]
        assert math.isfinite(ev["bpb"]) and ev["bpb"] > 0 and math.isfinite(ev["perplexity"])
        assert ev["random_guess_nll_per_token"] == pytest.approx(math.log(u))
    m = r["evaluate"]["metrics"]
    assert math.isfinite(m["bpb"]) and m["docs"] == r["data"]["eval_records"]
    # the evaluate stage on the exported model reproduces the finetune stage's own final evaluation
    assert m["bpb"] == pytest.approx(r["finetune"]["eval"]["bpb"], rel=1e-4)
    # finetuning a real LM on proteins beats guessing uniformly over the new tokens
    assert m["bpb"] < m["random_guess_bpb"]
    assert "--nproc_per_node=2" in r["translate"]["command"] and "--nproc_per_node=2" in r["finetune"]["command"]
    ft = json.loads((out / "runs" / "finetune" / "result.json").read_text())
    assert ft["world_size"] == 2 and ft["finished"]
    # P is a sparse coupling: fewer non-zeros than the dense v x u, columns non-empty
    assert 0 < r["translate"]["P"]["density"] < 1
    # mass-based sparsity of W = P / nu next to the non-zero count, and learned translations read from W with weights
    P = r["translate"]["P"]
    assert 0 < P["max_weight_mean"] <= 1 and 0 <= P["col_entropy_mean"] <= math.log(P["v"]) + 1e-6
    assert P["top"], "no learned translations shown"
    for tops in P["top"].values():
        ws = [w for _, w in tops]
        assert ws == sorted(ws, reverse=True) and all(0 < w <= 1 for w in ws) and sum(ws) <= 1 + 1e-3


def test_demo_export_loads_with_plain_transformers(demo):
    out, _ = demo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out / "model")).eval()
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    assert model.config.vocab_size == len(tok) == 512
    ids = tok("MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSPLHSVYVDQWDWERVMGDGERQFSTLKSTVEAIWAGIKATEAAVSEEFGLAPFLPDQIHFVHSQELLSRYPDLDAKGRERAIAKDLGAVFLVGIGGKLSDGHRHDVRAPDYDDWUAVAEAA", return_tensors="pt").input_ids
    with torch.no_grad():
        out_ = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out_.loss) and out_.logits.shape[-1] == 512
    gen = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False)
    assert gen.shape[1] == 16


def test_demo_tensorboard_logs_and_report(demo):
    out, _ = demo
    tr = out / "runs" / "translate" / "tb" / "global"
    ft = out / "runs" / "finetune" / "tb" / "global"
    losses = [v for _, v in tb_scalars(tr, "train/loss")]
    assert len(losses) >= 5 and tb_scalars(tr, "P/density")
    assert losses[-1] < losses[0]  # learning P through the frozen LM lowers its loss
    assert len(tb_scalars(ft, "train/loss")) >= 5
    assert (out / "runs" / "translate" / "P.safetensors").is_file()
    report = (out / "report.md").read_text()
    assert "random guess" in report and "S2T2 + CFT" in report and "tensorboard --logdir" in report
    assert "mean largest weight" in report and "mean column entropy" in report
    for cfg in ("translate", "finetune", "evaluate"):
        assert (out / "configs" / f"{cfg}.yaml").is_file()


def test_demo_rerun_reuses_finished_runs(demo):
    """A second run with the same settings finds every stage's finished result (nothing retrains)."""
    out, _ = demo
    first = json.loads((out / "results.json").read_text())
    assert first["reused_runs"] == []
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file()}
    proc = run_cmd([sys.executable, str(REPO / "launch" / "demo.py"), "--out", str(out), "--quiet", "--steps", "60"],
                   timeout=600)
    r = json.loads((out / "results.json").read_text())
    assert r["reused_runs"] == ["translate", "finetune", "evaluate"]
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # no run file was rewritten
    assert r["evaluate"]["metrics"] == first["evaluate"]["metrics"]
    assert "Done in" in proc.stdout
