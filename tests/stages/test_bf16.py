"""bf16 for real, on CPU (CPUs run bf16 autocast): the translator stays float32 inside autocast, and the translate
and finetune stages with train.precision=bf16 follow their float32 runs closely."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.finetune_fixtures import CTX, world  # noqa: F401 - the session fixture
from s2t2_dist.config import load_config
from s2t2_dist.translator import TokenTranslator


@pytest.mark.parametrize("kind", ["sparse", "softmax", "unconstrained"])
def test_translator_computes_in_float32_under_bf16_autocast(kind):
    """P, E', L' and the gradient on C are bit-identical with and without a bf16 autocast region around them (the
    matmuls P^T E would otherwise run in bf16: errors of ~1e-2 at these sizes)."""

    def run(autocast: bool):
        torch.manual_seed(0)
        t = TokenTranslator(40, 12, kind=kind, n_iter=3)
        with torch.no_grad():
            t.C.add_(torch.randn_like(t.C) * 0.05)
        E = torch.randn(40, 16, dtype=torch.bfloat16)  # a bf16 frozen model's embedding
        L = torch.randn(40, 16, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            P = t.P()
            E2, L2 = t.embed_and_head(E, L)
            loss = E2.square().sum() + L2.sum() + t.entropy_local()
        loss.backward()  # outside the region, as torch recommends and as the loop does (engine.backward)
        return P.detach(), E2.detach(), L2.detach(), t.C.grad

    ref, amp = run(False), run(True)
    for a, b in zip(ref, amp):
        assert b.dtype == torch.float32
        assert torch.equal(a, b)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_translate_stage_in_bf16_follows_float32(tmp_path):
    """The real stage 1 (frozen model loaded in bf16, its forward under bf16 autocast, C and the Sinkhorn float32)
    against the same run in float32: the loss curves agree to bf16 precision. The softmax
    translator: the sparse one's supports change discontinuously, so a rounding difference can pick another support
    and the curves part for reasons that have nothing to do with bf16 (its float32 P is checked exactly above)."""
    from s2t2_dist.recipes.llama2c import save_hf
    from s2t2_dist.stages.translate import TranslateConfig, run
    from tests.helpers.stage_fixtures import REPO, prepare_small
    from tests.stages.test_translate_stage import _losses, _overrides

    data, model = prepare_small(tmp_path / "data"), save_hf(tmp_path / "stories260k")
    curves = {}
    for prec in ("fp32", "bf16"):
        cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml",
                          _overrides(data, model, tmp_path / prec, "train.steps=6", "train.micro_batch_size=4",
                                     "train.log_every=1", "train.ckpt_every=0", "data.num_workers=0",
                                     "translator.kind=softmax", "optim.lr=0.5", f"train.precision={prec}"))
        assert run(cfg)["finished"]
        curves[prec] = [v for _, v in _losses(tmp_path / prec)[1]]
    f32, b16 = curves["fp32"], curves["bf16"]
    assert len(f32) == len(b16) == 6
    assert max(_rel(b, f) for b, f in zip(b16, f32)) < 0.02, (f32, b16)
    # step 1 is ln u in both (P = 1/v: every E' row equal, uniform logits); later steps differ: bf16 really ran
    assert f32[1:] != b16[1:]


def test_finetune_stage_in_bf16_follows_float32(world, tmp_path):
    """The real stage 2 (plain engine, float32 master weights, forward/backward under bf16 autocast) against
    float32: the same loss curve to bf16 precision, and it learns."""
    from s2t2_dist.stages.finetune import FinetuneConfig, run

    curves = {}
    for prec in ("fp32", "bf16"):
        cfg = load_config(FinetuneConfig, None, [
            f"run_dir={tmp_path / prec}", f"model.path={world.model_a}", f"data.train={world.new_train}",
            f"data.eval={world.new_eval}", f"data.tokenizer={world.tokenizer}", f"train.context_len={CTX}",
            f"init.p_file={world.p_file('softmax')}", "train.steps=4", "train.batch_size=2",
            "train.micro_batch_size=2", "train.log_every=1", "train.ckpt_every=0", "train.eval_max_docs=4",
            "optim.lr=1e-2", f"train.precision={prec}"])
        summary = run(cfg)
        assert summary["finished"]
        curves[prec] = ([l for _, l in summary["losses"]], summary["eval"]["bpb"])
    (f32, bpb32), (b16, bpb16) = curves["fp32"], curves["bf16"]
    assert max(_rel(b, f) for b, f in zip(b16, f32)) < 0.02, (f32, b16)
    assert f32 != b16  # bf16 really ran
    assert b16[-1] < b16[0]
    assert _rel(bpb16, bpb32) < 0.02


def test_bf16_on_a_cpu_that_emulates_it_is_said_once(monkeypatch, caplog):
    """train.precision=bf16 runs correctly on any CPU, but one without bf16 in hardware emulates it (~15x slower):
    a warning naming the key; none for fp32, none on a CPU that has it."""
    import logging

    from s2t2_dist.stages import common

    monkeypatch.setattr(common, "cpu_computes_bf16", lambda: False)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="s2t2.precision"):
        assert common.warn_emulated_bf16("train.precision", torch.bfloat16, cpu)
        assert not common.warn_emulated_bf16("train.precision", torch.float32, cpu)
    assert [r.getMessage().split(" on a CPU")[0] for r in caplog.records] == ["train.precision=bf16"]
    monkeypatch.setattr(common, "cpu_computes_bf16", lambda: True)
    assert not common.warn_emulated_bf16("train.precision", torch.bfloat16, cpu)


def test_the_bf16_probe_answers_for_this_cpu():
    """The answer is a bool either way; where it says bf16 is in hardware, a bf16 product runs through oneDNN."""
    from s2t2_dist.stages.common import cpu_computes_bf16

    assert isinstance(cpu_computes_bf16(), bool)
