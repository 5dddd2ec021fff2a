"""Stage 1 end to end on real files: prepared protein shards, a tiny OLMo from the real config, real launchers."""

import json
import logging
import re
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from s2t2_dist.config import load_config
from s2t2_dist.translator.pfile import load_p
from s2t2_dist.errors import PFileError
from s2t2_dist.stages.translate import TranslateConfig, run
from tests.helpers.stage_fixtures import NCCL_LIKE, REPO, run_cmd, small_inputs, tiny_olmo, torchrun


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    # a real pretrained LM (stories260K, trained on English stories elsewhere): learning P must lower its loss
    return small_inputs(tmp_path_factory)


def _overrides(data, model, run_dir, *extra):
    return [f"run_dir={run_dir}", f"model.path={model}", "model.source_vocab=all",
            f"data.train={data}/shards/new/train", f"data.eval={data}/shards/new/eval",
            f"data.tokenizer={data}/tokenizer", "train.context_len=64", "train.batch_size=4",
            "train.micro_batch_size=2", "train.log_every=2", "train.ckpt_every=3", "train.eval_max_docs=8",
            "translator.heatmap=[32,16]", *extra]


def _losses(run_dir):
    acc = EventAccumulator(str(run_dir / "tb" / "global"))
    acc.Reload()
    return acc, [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_translate_single_process_learns_and_exports(inputs, tmp_path):
    data, model = inputs
    cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml",
                      _overrides(data, model, tmp_path / "run", "train.steps=12", "train.micro_batch_size=4",
                                 "data.num_workers=0"))
    summary = run(cfg)
    assert summary["finished"] and summary["step"] == 12
    acc, losses = _losses(tmp_path / "run")
    first, last = losses[0][1], losses[-1][1]
    assert last < first - 0.05, losses  # learning P through the frozen LM lowers the loss
    tags = acc.Tags()
    for t in ("P/row_nnz_mean", "P/col_nnz_mean", "P/density", "P/entropy", "P/row_err", "P/col_err", "train/lr",
              "train/grad_norm", "train/tokens_per_s"):
        assert any(s.startswith(t) for s in tags["scalars"]), (t, tags["scalars"])
    assert "P/heatmap" in tags["images"]
    assert any("top_translations" in t for t in tags["tensors"])
    # the exported sparse P reloads, has the run's marginals, and its columns sum to nu exactly
    p = load_p(summary["p_file"])
    P = p.dense(torch.float64)
    assert P.shape == (p.source_ids.numel(), p.nu.numel()) and (P >= 0).all()
    torch.testing.assert_close(P.sum(0), p.nu.double(), atol=1e-6, rtol=0)
    # 3 Dykstra iterations end on the column projection: rows are only approximately mu (reported in TensorBoard)
    assert float(P.sum()) == pytest.approx(1.0, abs=1e-6)
    assert float(P.sum(1).sub(p.mu.double()).abs().mean()) < 0.5 * float(p.mu.mean())
    assert (P > 0).float().mean() < 0.95  # sparsity has begun to appear (the paper init 1/v is fully dense)
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    # result.json: P's sparsity at the start and the end, the end's from the exported file; no warning
    st = p.stats()
    # the shipped start (FVT blend, source marginal start, floor 1) is sparse and stays so
    assert res["P"]["start"]["density"] < 0.2 and res["P"]["end"]["density"] == pytest.approx(st["density"])
    assert res["P"]["end"]["col_nnz_mean"] == pytest.approx(st["col_nnz_mean"])
    assert res["P"]["end"]["col_nnz_mean"] <= res["P"]["start"]["col_nnz_mean"]
    assert res["P"]["end"]["col_entropy_mean"] == pytest.approx(st["col_entropy_mean"], rel=1e-4)
    assert res["P"]["warning"] == ""
    # the automatic step keeps C's gradient alive; mass-based sparsity is logged
    assert res["gradient_on_C"]["frozen"] is False and res["gradient_on_C"]["live_grad_frac_at_end"] > 0.01, res
    assert res["gradient_on_C"]["start_warning"] == "" and res["gradient_on_C"]["lr"] == pytest.approx(0.015 / p.nu.numel())
    for t in ("P/max_weight_mean", "P/col_entropy_mean", "C/grad_live_frac", "C/grad_frozen_steps"):
        assert t in tags["scalars"], (t, tags["scalars"])
    assert res["eval"]["bpb"] > 0 and res["eval"]["random_guess_nll_per_token"] == pytest.approx(
        __import__("math").log(p.nu.numel()))
    with pytest.raises(PFileError, match="different target tokenizer"):
        p.check_compatible(p.source_tokenizer_hash, "0" * 64)
    # the route each op took, no fallback (on a CPU: the torch steps, the product's CPU kernel), in TensorBoard too
    assert res["routes"]["sinkhorn"] == {"route": "torch steps", "why": "a CPU device (the kernels are CUDA's)",
                                         "fallback": False, "device": "cpu"}, res["routes"]
    assert res["routes"]["product"]["route"] in ("gathered live rows", "dense GEMMs"), res["routes"]
    assert not res["routes"]["product"]["fallback"] and any("routes" in t for t in tags["tensors"]), tags["tensors"]
    # the run again with its result cut short: it resumes at its last step (nothing left to train) and reports the
    # gradient monitor of the run (carried in the checkpoint), not of no step
    (tmp_path / "run" / "result.json").write_text(json.dumps(res)[:100])
    again = run(cfg)
    assert again["step"] == 12 and again["gradient_on_C"] == res["gradient_on_C"], again["gradient_on_C"]


@pytest.mark.slow
def test_translate_torchrun_two_ranks_resume_is_identical(inputs, tmp_path):
    """2 gloo ranks, C sharded by columns (u not divisible by 2 is handled by the translator): an interrupted
    run resumed from its checkpoint gives exactly the uninterrupted run's loss curve and P. The default process
    group has no CPU backend (NCCL_LIKE), so every bookkeeping collective of the loop, checkpoints, evaluation and
    P statistics must take its CPU tensors to the gloo group, as on a GPU node."""
    data, model = inputs
    script = str(REPO / "launch" / "translate.py")
    cfgfile = str(REPO / "configs" / "translate_olmo1b.yaml")
    ref = tmp_path / "ref"
    torchrun(2, script, "--config", cfgfile, *_overrides(data, model, ref, "train.steps=6", "train.eval_max_docs=4"),
             env=NCCL_LIKE)
    split = tmp_path / "split"
    torchrun(2, script, "--config", cfgfile,
             *_overrides(data, model, split, "train.steps=6", "train.stop_after=4", "train.eval_max_docs=4"),
             env=NCCL_LIKE)
    assert not (split / "P.safetensors").exists()
    torchrun(2, script, "--config", cfgfile, *_overrides(data, model, split, "train.steps=6", "train.eval_max_docs=4"),
             env=NCCL_LIKE)
    _, ref_losses = _losses(ref)
    _, split_losses = _losses(split)
    assert [s for s, _ in ref_losses] == [2, 4, 6]
    assert dict(split_losses) == dict(ref_losses)
    a, b = load_p(ref / "P.safetensors"), load_p(split / "P.safetensors")
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


@pytest.mark.slow
def test_translate_frozen_lm_partitioned_with_fsdp_matches_replicated(inputs, tmp_path):
    """model.partition=fsdp shards the frozen LM's blocks over the 2 ranks; the learning is the same. Evaluation is
    on: the ranks' documents take different numbers of windows, and the lock-step scorer keeps the blocks'
    all-gathers paired (no hang). train.eval_max_docs=5 means the documents of global index < 5 at any rank count:
    1 rank and 2 ranks (replicated or sharded) score the same 5 documents to the same BpB."""
    data, model = inputs
    script = str(REPO / "launch" / "translate.py")
    cfgfile = str(REPO / "configs" / "translate_olmo1b.yaml")
    common = ["train.steps=4", "train.eval_max_docs=5", "eval.batch_size=3"]
    one = run(load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml",
                          _overrides(data, model, tmp_path / "one", *common, "data.num_workers=0")))
    runs, evals = {}, {}
    for part in ("none", "fsdp"):
        torchrun(2, script, "--config", cfgfile, *_overrides(data, model, tmp_path / part, *common,
                                                              f"model.partition={part}"), timeout=240)
        runs[part] = _losses(tmp_path / part)[1]
        res = json.loads((tmp_path / part / "result.json").read_text())
        frac, evals[part] = res["lm_param_fraction_per_rank"], res["eval"]
        assert frac == 1.0 if part == "none" else frac < 0.8  # the blocks (most of the LM) are halved
    assert [s for s, _ in runs["fsdp"]] == [2, 4]
    for (_, a), (_, b) in zip(runs["none"], runs["fsdp"]):
        assert a == pytest.approx(b, rel=1e-5)
    pa, pb = load_p(tmp_path / "none" / "P.safetensors"), load_p(tmp_path / "fsdp" / "P.safetensors")
    torch.testing.assert_close(pa.dense(), pb.dense(), atol=1e-6, rtol=1e-4)
    for e in evals.values():
        assert (e["docs"], e["tokens"], e["bytes"]) == (5, one["eval"]["tokens"], one["eval"]["bytes"]), (e, one)
        assert e["bpb"] == pytest.approx(one["eval"]["bpb"], rel=1e-4)


def test_translate_activation_checkpointing_lowers_peak_memory(inputs, tmp_path):
    """model.activation_checkpointing=true recomputes the frozen blocks in backward: the peak memory of the real
    command (one process, 64 x 64 tokens per micro-batch through a 12-block, 256-wide model) drops, and the loss is the
    same (dropout stays off: only the blocks' own training flags are set)."""
    data, _ = inputs
    model = tiny_olmo(tmp_path / "olmo", n_layers=12, d_model=256, n_heads=4)
    script = str(REPO / "launch" / "translate.py")
    cfgfile = str(REPO / "configs" / "translate_olmo1b.yaml")
    peak, loss = {}, {}
    for ac in ("false", "true"):
        run_cmd([sys.executable, script, "--config", cfgfile,
                 *_overrides(data, model, tmp_path / ac, "train.steps=2", "train.batch_size=64",
                             "train.micro_batch_size=64", "train.log_every=1", "data.eval=", "data.num_workers=0",
                             f"model.activation_checkpointing={ac}")])
        acc, losses = _losses(tmp_path / ac)
        loss[ac] = [v for _, v in losses]
        node = EventAccumulator(str(tmp_path / ac / "tb" / "node_000"))
        node.Reload()
        peak[ac] = max(e.value for e in node.Scalars("node/cpu_rss_max_gib"))
    assert loss["true"] == pytest.approx(loss["false"], rel=1e-5)
    # GiB: the 12 blocks' activations are not kept (measured 2.15 -> 1.28 GiB; at 8 x 128 the drop, ~0.07 GiB, was
    # within the run's other peaks once the translator's per-step work joined them)
    assert peak["true"] < peak["false"] - 0.4, peak


def test_translate_warns_and_flags_a_frozen_C(inputs, tmp_path, caplog):
    """The paper's recipe with an lr far past the 1/v scale: warned about at start; C's gradient dies, which is
    warned about once and recorded in result.json (the default run above records frozen=False). How long it stays
    dead is chaotic at this lr: a few entries regain a gradient for a step or two, at steps that differ between
    CPUs (AVX-512 and AVX2 sum in other orders), so the monitor counts one stalled sample (freeze_steps=1) and the
    warning must come once however often the stall recurs."""
    data, model = inputs
    cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml",
                      _overrides(data, model, tmp_path / "run", "train.steps=30", "train.micro_batch_size=4",
                                 "data.eval=", "translator.init=uniform", "translator.alpha=0", "translator.floor=0",
                                 "optim.lr=3", "translator.freeze_steps=1",
                                 "train.log_every=1"))
    with caplog.at_level(logging.WARNING, logger="s2t2.translate"):
        summary = run(cfg)
    g = json.loads((tmp_path / "run" / "result.json").read_text())["gradient_on_C"]
    assert g == summary["gradient_on_C"]
    assert g["frozen"] is True and g["frozen_at_step"] <= 30 and g["live_grad_frac_at_end"] < 1e-3, g
    assert g["lr"] == 3.0 and g["lr_x_v"] == 1536
    assert "freezing range" in caplog.text and "freezing range" in g["start_warning"]
    assert caplog.text.count("exactly zero for") == 1, caplog.text


def test_translate_fvt_start_maps_shared_tokens_to_themselves(inputs, tmp_path, caplog):
    """translator.init=fvt: the surface-string start puts each target token that IS a source token on itself."""
    from s2t2_dist.data.tokenizers import load_tokenizer, source_surface_bytes, token_bytes

    data, model = inputs
    cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml",
                      _overrides(data, model, tmp_path / "run", "train.steps=1", "train.micro_batch_size=4",
                                 "data.num_workers=0", "data.eval=", "optim.lr=1e-9", "translator.init=fvt",
                                 "translator.init_weight=0.9", "translator.source_marginal=uniform",
                                 "translator.floor=0"))  # the earlier dense blend start
    with caplog.at_level(logging.WARNING, logger="s2t2.translate"):
        summary = run(cfg)
    # one step at lr 1e-9: P is its start, which the summary warns about
    assert "no sparser than its start" in summary["P"]["warning"] and summary["P"]["warning"] in caplog.text
    assert summary["P"]["end"]["col_nnz_mean"] == summary["P"]["start"]["col_nnz_mean"]
    p = load_p(summary["p_file"])
    top = p.dense().argmax(0).tolist()  # the largest weight P/nu of each column: its largest entry
    # the regular token of a string, not its byte-fallback twin (<0x41> for "A"): the one the tokenizer writes
    src = source_surface_bytes(str(model), p.source_ids.tolist())
    row = {b: r for r, b in enumerate(src) if b}
    assert len(row) == sum(1 for b in src if b)  # no string twice
    tgt = token_bytes(load_tokenizer(f"{data}/tokenizer").tokenizer)
    shared = [(j, row[b]) for j, b in tgt.items() if b and b in row]
    assert len(shared) >= 20  # the residue letters are letters of the English vocabulary too
    assert sum(top[j] == r for j, r in shared) == len(shared)


@pytest.mark.parametrize("key", ["translator.init_weight=2", "translator.floor=-2", "translator.freeze_steps=-1"])
def test_translator_settings_out_of_range_are_refused(key):
    from s2t2_dist.errors import ConfigError

    with pytest.raises(ConfigError, match=key.split(".")[1].split("=")[0]):
        load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml", [key])


def test_steps_zero_scores_the_start_and_separates_unbuilt_columns(inputs, tmp_path):
    """`train.steps=0` (the real command, --no-progress): no training; the start (here the FVT plan itself,
    init_weight 1) is exported as the P file and scored on the eval split. result.json's sparsity separates the
    target columns that no source piece builds (the FVT start gives them a column over every source row)."""
    from s2t2_dist.data.tokenizers import load_hf_tokenizer, load_tokenizer, source_token_ids
    from s2t2_dist.translator.start import surface_decomposition

    data, model = inputs
    run_dir = tmp_path / "start"
    proc = run_cmd([sys.executable, "-m", "s2t2_dist.cli", "translate", "--config",
                    str(REPO / "configs" / "translate_olmo1b.yaml"), "--no-progress",
                    *_overrides(data, model, run_dir, "train.steps=0", "translator.init_weight=1",
                                "data.num_workers=0")])
    # no bar at all: not the training loop's (tqdm "train: 0it [...]"), not transformers' "Loading weights"
    assert not re.search(r"\btrain: +(\d+%|\d+it)|Loading weights|it/s\]", proc.stderr), proc.stderr[-2000:]
    res = json.loads((run_dir / "result.json").read_text())
    assert res["finished"] and res["step"] == 0 and res["final_loss"] is None
    assert res["eval"]["bpb"] > 0
    p = load_p(res["p_file"])
    v, u = p.shape
    assert res["P"]["end"]["density"] == pytest.approx(res["P"]["start"]["density"])  # P is the start
    assert res["P"]["end"]["density"] == pytest.approx(p.stats()["density"])
    src_tok = load_hf_tokenizer(str(model))
    dec = surface_decomposition(src_tok, source_token_ids(src_tok, "all").tolist(),
                                load_tokenizer(f"{data}/tokenizer"))
    unbuilt = [j for j, pieces in enumerate(dec.pieces) if not pieces]
    assert unbuilt  # the target's <pad>/<unk>/specials without a source role
    cols = (p.dense() != 0).sum(0)
    for key in ("start", "end"):
        st = res["P"][key]
        assert st["unbuilt_columns"] == len(unbuilt)
        assert st["col_nnz_mean_unbuilt"] == pytest.approx(float(cols[unbuilt].double().mean()))
        built = [j for j in range(u) if j not in set(unbuilt)]
        assert st["col_nnz_mean_built"] == pytest.approx(float(cols[built].double().mean()))
        assert st["density_built"] == pytest.approx(float(cols[built].sum()) / (v * len(built)))
    # the FVT start: unbuilt columns spread over the pieces the built columns use (the start's marginal: no mass
    # on source rows that no piece uses), the built ones hold a few pieces each
    piece_rows = {i for pieces in dec.pieces for i in pieces}
    assert res["P"]["start"]["col_nnz_mean_unbuilt"] == len(piece_rows) < 0.5 * v
    assert res["P"]["start"]["col_nnz_mean_built"] < 4
    assert res["P"]["start"]["density_built"] < res["P"]["start"]["density"]
