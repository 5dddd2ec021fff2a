"""The loop's callbacks (train/callbacks.py), the Task base class, start-up phases (train/phases.py), FLOPs and
MFU (train/flops.py), the engines' start-up choices (activation checkpointing by memory, ZeRO-3 buckets by block,
per-block compile), FSDP2's meta-device build, and one rank's process group under torchrun."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.distributed import run_distributed
from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.train.loop import Task, train
from s2t2_dist.train.metrics import MetricsLogger
from tests.helpers.toy import make

REPO = Path(__file__).resolve().parents[2]


def _toy_run(run_dir, overrides=(), task=None, **kw):
    tcfg, toy_task, engine, loader = make(8, overrides)
    log = MetricsLogger(run_dir / "tb", rank=0, node_rank=0, local_rank=0)
    res = train(tcfg, task or toy_task, engine, loader, Checkpointer(run_dir), log, progress=False, **kw)
    log.close()
    return res


def test_task_with_only_a_loss_trains(tmp_path):
    """Every hook but loss() is a no-op of the base class: the loop calls them without probing."""
    tcfg, toy, engine, loader = make(4)

    class LossOnly(Task):
        def loss(self, batch):
            return toy.loss(batch)

    res = train(tcfg, LossOnly(), engine, loader, Checkpointer(tmp_path), MetricsLogger(tmp_path, 0, 0, 0, False),
                progress=False)
    assert res.finished and len(res.losses) == 4
    with pytest.raises(NotImplementedError):
        Task().loss({})


def test_step_split_and_memory_on_logging_steps(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="s2t2.train"):
        _toy_run(tmp_path)
    node = EventAccumulator(str(tmp_path / "tb" / "node_000"))
    node.Reload()
    tags = node.Tags()["scalars"]
    for phase in ("data", "forward", "backward", "optimizer"):
        assert [e.step for e in node.Scalars(f"node/split_{phase}_s")] == [2, 4, 6, 8]
    assert "node/cpu_rss_max_gib" in tags and "node/tokens_per_s" in tags
    lines = [r.getMessage() for r in caplog.records if r.name == "s2t2.train"]
    assert len(lines) == 4 and lines[0].startswith("step 2: ") and "forward" in lines[0]
    # said once: why there is no MFU (no FLOPs per token given, on a CPU)
    assert sum("MFU not reported" in line for line in lines) == 1


def test_a_task_phase_before_the_micro_batches_is_timed(tmp_path, caplog):
    """A task's before_step work (stage 1: the plan) is a phase of the split, not time outside every phase."""
    import time

    _, toy, _, _ = make(8)

    class Planning(Task):
        before_step_phase = "plan"

        def before_step(self, steps_done, logging):
            time.sleep(0.05)

        def loss(self, batch):
            return toy.loss(batch)

    with caplog.at_level(logging.INFO, logger="s2t2.train"):
        _toy_run(tmp_path, task=Planning())
    node = EventAccumulator(str(tmp_path / "tb" / "node_000"))
    node.Reload()
    plan = node.Scalars("node/split_plan_s")
    assert [e.step for e in plan] == [2, 4, 6, 8] and min(e.value for e in plan) >= 0.05
    assert max(e.value for e in node.Scalars("node/split_data_s")) < 0.05  # the plan is not counted as data wait
    lines = [r.getMessage() for r in caplog.records if r.name == "s2t2.train"]
    assert "this step: plan " in lines[0]


def test_profile_window_writes_a_trace(tmp_path):
    _toy_run(tmp_path, ["profile=[3,4]"])
    traces = list((tmp_path / "tb" / "profile").glob("rank00000*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)


def test_profile_key_is_checked():
    from s2t2_dist.config import load_config
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.train.config import TrainConfig

    for bad in ("[3]", "[0,2]", "[5,4]"):
        with pytest.raises(ConfigError, match="profile"):
            load_config(TrainConfig, None, [f"profile={bad}"])


def test_on_step_and_extra_callbacks(tmp_path):
    from s2t2_dist.train.callbacks import Callback

    seen = []

    class Spy(Callback):
        def on_step_loss(self, step, loss, applied):
            seen.append((step, applied))

    res = _toy_run(tmp_path, callbacks=[Spy()], on_step=lambda s, loss: seen.append(("on_step", s)))
    assert [s for s, a in seen if s != "on_step"] == [s for s, _ in res.losses] == list(range(1, 9))
    assert [s for k, s in seen if k == "on_step"] == list(range(1, 9))


def test_phases_logged_and_summarised(caplog, monkeypatch):
    import time

    import s2t2_dist.train.phases as phases

    monkeypatch.setattr(phases, "ANNOUNCE_S", 0.05)
    rec = phases.reset()
    with caplog.at_level(logging.INFO, logger="s2t2.startup"):
        with phases.phase("model load"):
            time.sleep(0.3)  # long enough to be announced
            with phases.phase("sharding"):  # nested: an engine's phase inside the stage's; too short to announce
                pass
        phases.begin(phases.FIRST_STEP)
        phases.end(phases.FIRST_STEP)
    s = rec.summary()
    assert list(s["phases_s"]) == ["sharding", "model load", phases.FIRST_STEP]
    assert s["first_step_done_s"] is not None and s["before_stage_s"] is not None
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "startup: model load ..." and any(m.startswith("startup: sharding took") for m in msgs)
    assert "startup: sharding ..." not in msgs
    assert phases.end("never begun") is None


def test_a_phase_that_fails_at_once_logs_nothing(caplog):
    """A user error found in a phase (preflight) stays one line: no 'startup' line before or after it."""
    import s2t2_dist.train.phases as phases

    phases.reset()
    with caplog.at_level(logging.INFO, logger="s2t2.startup"), pytest.raises(ValueError):
        with phases.phase("preflight"):
            raise ValueError("a key out of range")
    assert [r.getMessage() for r in caplog.records] == []


def test_peak_table_and_flops():
    from transformers import OlmoConfig, OlmoForCausalLM

    from s2t2_dist.train.flops import flops_per_token, matmul_params, mfu, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Tesla T4") is None and peak_flops(None) is None
    assert mfu(6e9, 1000.0, None) is None and mfu(6e9, 1000.0, 989e12) == pytest.approx(6e12 / 989e12)
    for tie in (True, False):
        cfg = OlmoConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, tie_word_embeddings=tie)
        m = OlmoForCausalLM(cfg)
        total = sum(p.numel() for p in m.parameters())
        emb = 100 * 16
        assert matmul_params(m) == (total if tie else total - emb)  # the lookup is no matmul; a tied head is
        assert flops_per_token(m, 64) == 6 * matmul_params(m) + 12 * 2 * 16 * 64


def test_activation_checkpointing_by_memory_and_block_buckets():
    from transformers import OlmoConfig

    from s2t2_dist.engines.model_setup import activation_memory, wants_activation_checkpointing
    from s2t2_dist.engines.deepspeed_engine import block_numel, resolve_ds_config
    from s2t2_dist.train.config import OptimConfig, TrainConfig

    olmo1b = json.loads((REPO / "s2t2_dist/assets/olmo/OLMo-1B-hf.config.transcribed.json").read_text())
    cfg = OlmoConfig(**{k: v for k, v in olmo1b.items() if k in OlmoConfig().to_dict()})
    assert block_numel(cfg) == 4 * 2048**2 + 3 * 2048 * 8192  # 67.1 M: q, k, v, o and the gated MLP
    assert activation_memory(cfg, 16, 512) == 34 * 16 * 512 * 2048 * 16 + 10 * 16 * 512 * 50304
    # the chunked loss (engine.loss_chunk_tokens): one float32 chunk of logits, its gradient in place, the kept
    # gradients of the hidden states (bf16) and the head (float32) instead of every logit three times: 4.1 -> 1.3 GB
    body = 34 * 16 * 512 * 2048 * 16
    chunked = activation_memory(cfg, 16, 512, 2048) - body
    assert chunked == 8 * 2048 * 50304 + 2 * 16 * 512 * 2048 + 4 * 50304 * 2048
    assert chunked < (activation_memory(cfg, 16, 512) - body) / 3
    assert wants_activation_checkpointing(True, cfg, 1, 1, 1, 1) is True
    assert wants_activation_checkpointing(False, cfg, 10**12, 64, 4096, 1) is False
    if not torch.cuda.is_available():
        assert wants_activation_checkpointing("auto", cfg, 10**12, 64, 4096, 1) is False  # never on a CPU
    # offloaded states are not on the GPU: OLMo-7B's 112 GB of states count on one GPU only when they stay there
    from s2t2_dist.engines.model_setup import device_state_bytes

    assert device_state_bytes(7 * 10**9, 1, offload=False) == 112e9 and device_state_bytes(7 * 10**9, 1, True) == 0
    assert device_state_bytes(7 * 10**9, 8, offload=False) == 14e9
    ds = resolve_ds_config(REPO / "configs/ds_zero3.json", train_cfg=TrainConfig(batch_size=16, micro_batch_size=8),
                           optim_cfg=OptimConfig(), world_size=2, hidden_size=2048, block_numel=block_numel(cfg))
    z = ds["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == z["reduce_bucket_size"] == block_numel(cfg)
    assert z["stage3_param_persistence_threshold"] == 100_000
    assert ds["communication_data_type"] == "fp32"


def test_compile_is_refused_for_deepspeed():
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.engines.build import EngineConfig

    with pytest.raises(ConfigError, match="compile"):
        EngineConfig(kind="deepspeed", ds_config=str(REPO / "configs/ds_zero3.json"), compile=True).validate()


@pytest.mark.slow  # the first compile of two blocks with inductor on a CPU: about a minute
def test_compiled_blocks_train_like_eager():
    """engine.compile: each block's forward compiled in place (parameter names unchanged); one step of the plain
    engine gives the eager loss and gradients."""
    from tests.helpers.engines_tiny import tiny_olmo_config
    from s2t2_dist.engines.build import EngineConfig, build_model_and_engine
    from s2t2_dist.models.hf import transformer_blocks
    from s2t2_dist.train.config import OptimConfig, TrainConfig

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model, eng = build_model_and_engine(EngineConfig(kind="plain", compile=compiled), tiny_olmo_config(),
                                            OptimConfig(), TrainConfig(steps=2, micro_batch_size=2, batch_size=2))
        loss = eng.module(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        out[compiled] = (float(loss), [p.grad.clone() for p in model.parameters()], [n for n, _ in
                                                                                    model.named_parameters()])
        if compiled:
            assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in transformer_blocks(model))
    assert out[True][2] == out[False][2]
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _fsdp_from_dir(model_dir: str, tie: bool):
    import torch.distributed as dist

    from tests.helpers.engines_tiny import tiny_olmo
    from s2t2_dist.engines.build import EngineConfig, build_model_and_engine
    from s2t2_dist.train.config import OptimConfig, TrainConfig

    if dist.get_rank() == 0:  # shards of ~200 KB: several files, tensors split across them by the index
        tiny_olmo(tie=tie, seed=3, vocab=515).save_pretrained(model_dir, max_shard_size="200KB")
    dist.barrier()
    model, eng = build_model_and_engine(EngineConfig(kind="fsdp"), model_dir, OptimConfig(), TrainConfig(steps=2))
    meta_built = all(hasattr(p, "to_local") for p in model.parameters())
    sd = eng.consolidated_state_dict()
    return meta_built, {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_fsdp_meta_build_loads_every_shard_exactly(tmp_path, tie):
    """From a safetensors directory FSDP2 builds on the meta device and each rank reads only its rows: the gathered
    weights equal transformers' own load (vocabulary 515: uneven shards of the embedding over 2 ranks)."""
    from transformers import AutoModelForCausalLM

    results = run_distributed(_fsdp_from_dir, 2, str(tmp_path / "m"), tie, timeout=300)
    assert all(built for built, _ in results)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).state_dict()
    got = results[0][1]
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_one_rank_group_under_torchrun(tmp_path):
    """`torchrun --nproc_per_node 1` + a 1-rank group (FSDP2 needs one): joins through the launcher's store. A group
    on a fresh port made rank 0 a client of a store nobody serves, waiting the whole timeout (here 20 s)."""
    script = tmp_path / "pg.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        from s2t2_dist.distributed.env import init_distributed
        init_distributed(single_rank_group=True, timeout_s=20)
        print("WORLD", dist.get_world_size(), flush=True)
        dist.destroy_process_group()
    """))
    from tests.helpers.distributed import free_port

    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--nproc_per_node", "1", "--master_port", str(free_port()), str(script)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "WORLD 1" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


def test_train_is_short_and_probes_no_hooks():
    """The loop's extras are callbacks (train() <= 130 lines) and the task's hooks are the Task base class's,
    called without getattr probing."""
    import ast

    src = (REPO / "s2t2_dist/train/loop.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert fn.end_lineno - fn.lineno + 1 <= 130
    assert not [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"
                and getattr(n.args[0], "id", "") in ("task", "engine")]
