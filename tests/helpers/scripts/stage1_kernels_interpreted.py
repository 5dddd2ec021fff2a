"""Stage 1 in its real order of calls with the sparse Sinkhorn's CUDA route, on a CPU by Triton's interpreter.

Not collected by itself (not test_*.py): tests/ot/test_gpu_kernels.py runs it in a pytest of its own with
TRITON_INTERPRET=1 in the environment from the start. The CPU device is routed as CUDA is (``kernel_device``), so
the route's first-use check, its fallback and its record run as on a GPU; the plan product keeps its CPU kernel.
"""
import json
import os

import torch

import s2t2_dist.ot.routing as routing
import s2t2_dist.ot.dykstra_triton as dt
import s2t2_dist.ot.sinkhorn as sinkhorn
from s2t2_dist.config import load_config
from s2t2_dist.stages.translate import TranslateConfig, run
from tests.helpers.stage_fixtures import REPO, small_inputs

assert os.environ.get("TRITON_INTERPRET") == "1"


def test_stage1_plans_come_from_the_kernels_from_the_first_call(tmp_path_factory, tmp_path, monkeypatch):
    """Every Sinkhorn call of a translate run (the start's statistics under no_grad first, then the training steps
    and their backward, then the end's statistics and the evaluation) is served by the kernels, none by the torch
    steps; result.json says so."""
    data, model = small_inputs(tmp_path_factory)
    monkeypatch.setattr(routing, "kernel_device", lambda device: True)
    from tests.helpers.scripts.sinkhorn_triton_interpreted import FAST_TILES

    for k, val in FAST_TILES.items():  # (the interpreter's time follows the number of programs)
        monkeypatch.setattr(dt, k, val)
    routing.kernels_ok.cache_clear()
    calls = []
    real = sinkhorn.dykstra

    def counted(C, steps, n_iter=3):
        calls.append((type(steps).__name__, torch.is_grad_enabled()))
        return real(C, steps, n_iter)

    monkeypatch.setattr(sinkhorn, "dykstra", counted)
    before = dt.launches[0]
    run_dir = tmp_path / "run"
    cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml", [
        f"run_dir={run_dir}", f"model.path={model}", "model.source_vocab=all", f"data.train={data}/shards/new/train",
        f"data.eval={data}/shards/new/eval", f"data.tokenizer={data}/tokenizer", "train.context_len=64",
        "train.batch_size=2", "train.micro_batch_size=2", "train.steps=2", "train.log_every=1",
        "train.eval_max_docs=2", "data.num_workers=0", "translator.heatmap=[16,16]"])
    summary = run(cfg, progress=False)
    assert summary["finished"]
    assert calls and calls[0][1] is False, calls  # the first plan is taken under no_grad (the start's statistics)
    assert any(grad for _, grad in calls), calls  # and training's plans with autograd
    served = [name for name, _ in calls]
    assert served.count("TritonSteps") == len(served), served  # 100% of the calls
    assert dt.launches[0] - before >= 6 * len(served)  # (3 iterations x 2 projections a forward)
    res = json.loads((run_dir / "result.json").read_text())
    assert res["routes"]["sinkhorn"]["route"] == "kernels" and res["routes"]["sinkhorn"]["fallback"] is False, res
    assert res["routes"]["product"]["route"] in ("gathered live rows", "dense GEMMs"), res  # (its CPU kernel)
