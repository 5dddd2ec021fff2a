"""Engine selection and DeepSpeed config derivation (no processes started)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.engines.build import EngineConfig, build_model_and_engine, engine_kind
from s2t2_dist.engines.launcher import parse_launcher_args
from s2t2_dist.engines.deepspeed_engine import check_ds_config_file, resolve_ds_config
from s2t2_dist.train.config import OptimConfig, TrainConfig
from s2t2_dist.train.optim import param_groups

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {n: ROOT / "configs" / f"{n}.json" for n in ("ds_zero2", "ds_zero3", "ds_zero3_offload")}


def _resolve(raw, world=2, gpu=False, batch=16, micro=2, clip=1.0, precision="auto", **kw):
    return resolve_ds_config(raw, train_cfg=TrainConfig(batch_size=batch, micro_batch_size=micro, precision=precision),
                             optim_cfg=OptimConfig(grad_clip=clip), world_size=world, on_gpu=gpu, **kw)


def _write(tmp_path, cfg: dict) -> Path:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("world,micro,accum", [(1, 2, 8), (2, 2, 4), (8, 2, 1), (4, 1, 4)])
def test_shipped_configs_get_their_batch_keys_from_the_run_config(name, world, micro, accum):
    cfg = _resolve(CONFIGS[name], world=world, micro=micro, hidden_size=4096)
    assert cfg["train_batch_size"] == 16
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert cfg["gradient_accumulation_steps"] == accum
    assert cfg["train_batch_size"] == micro * accum * world
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": False}  # CPU
    assert "auto" not in json.dumps(cfg)
    if cfg["zero_optimization"]["stage"] == 3:
        z = cfg["zero_optimization"]
        assert z["reduce_bucket_size"] == 4096**2
        assert z["stage3_param_persistence_threshold"] == 40960


def test_bf16_on_gpu_follows_precision():
    assert _resolve(CONFIGS["ds_zero3"], gpu=True)["bf16"]["enabled"] is True
    assert _resolve(CONFIGS["ds_zero3"], gpu=True, precision="bf16")["bf16"]["enabled"] is True
    assert _resolve(CONFIGS["ds_zero3"], gpu=True, precision="fp32")["bf16"]["enabled"] is False
    assert _resolve(CONFIGS["ds_zero3_offload"], gpu=True)["zero_optimization"]["offload_param"]["pin_memory"] is True
    # no pinned memory without CUDA
    assert _resolve(CONFIGS["ds_zero3_offload"])["zero_optimization"]["offload_param"]["pin_memory"] is False


def test_explicit_conflicting_batch_value_names_key_and_both_values(tmp_path):
    p = _write(tmp_path, {"train_batch_size": 32, "zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError) as e:
        _resolve(p)
    msg = str(e.value)
    assert str(p) in msg and "train_batch_size=32" in msg and "16" in msg and "train.batch_size" in msg

    p = _write(tmp_path, {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2 .* gives 4"):
        _resolve(p)
    p = _write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=4"):
        _resolve(p)


def test_explicit_agreeing_values_are_accepted(tmp_path):
    p = _write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                          "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}})
    cfg = _resolve(p)
    assert (cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) == (16, 4)


def test_missing_keys_are_filled(tmp_path):
    cfg = _resolve(_write(tmp_path, {"zero_optimization": {"stage": 1}}), world=4, micro=4, clip=0.5)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (16, 4, 1)
    assert cfg["gradient_clipping"] == 0.5


def test_impossible_layout_and_clip_conflict(tmp_path):
    with pytest.raises(ConfigError, match="not a multiple"):
        _resolve(CONFIGS["ds_zero3"], world=3)
    with pytest.raises(ConfigError, match=r"gradient_clipping=1.0 .*optim.grad_clip=0.5"):
        _resolve(_write(tmp_path, {"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}), clip=0.5)
    with pytest.raises(ConfigError, match="bf16.enabled=True"):
        _resolve(_write(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}), gpu=False)


@pytest.mark.parametrize("bad,match", [
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3}}, "remove the 'optimizer' section"),
    ({"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 3}}, "remove the 'scheduler' section"),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}, "fp16"),
    ({"zero_optimization": {"stage": 0}}, "stage must be 1, 2 or 3"),
    ({}, "stage must be 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs stage 3"),
])
def test_rejected_ds_configs(tmp_path, bad, match):
    with pytest.raises(ConfigError, match=match):
        _resolve(_write(tmp_path, bad))


def test_overrides_and_offload_flag():
    cfg = _resolve(CONFIGS["ds_zero3"], overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
                   hidden_size=64)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    off = _resolve(CONFIGS["ds_zero3"], offload=True)["zero_optimization"]
    assert off["offload_optimizer"]["device"] == "cpu" and off["offload_param"]["device"] == "cpu"
    z2 = _resolve(CONFIGS["ds_zero2"], offload=True)["zero_optimization"]
    assert z2["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z2
    # without a model width the "auto" bucket sizes fall back to DeepSpeed's defaults
    assert "reduce_bucket_size" not in _resolve(CONFIGS["ds_zero3"])["zero_optimization"]


def test_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="DeepSpeed config file not found: .*nope.json"):
        _resolve(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        check_ds_config_file(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------------------------- EngineConfig


@dataclass
class _Run:
    engine: EngineConfig = field(default_factory=EngineConfig)


def test_engine_config_validation(tmp_path):
    EngineConfig().validate()
    EngineConfig(kind="fsdp", activation_checkpointing=True).validate()
    EngineConfig(kind="deepspeed", ds_config=str(CONFIGS["ds_zero3"])).validate()
    with pytest.raises(ConfigError, match="kind=deepspeed needs a DeepSpeed JSON config"):
        EngineConfig(kind="deepspeed").validate()
    with pytest.raises(ConfigError, match=r"not found: .*missing/ds.json"):
        EngineConfig(kind="deepspeed", ds_config=str(tmp_path / "missing" / "ds.json")).validate()
    with pytest.raises(ConfigError, match=r"engine.kind=fsdp \(FSDP2 already shards"):
        EngineConfig(kind="fsdp", ds_config=str(CONFIGS["ds_zero3"])).validate()
    with pytest.raises(ConfigError, match="kind=plain"):
        EngineConfig(kind="plain", ds_config=str(CONFIGS["ds_zero2"])).validate()
    with pytest.raises(ConfigError, match="plain engine cannot offload"):
        EngineConfig(kind="plain", offload=True).validate()
    with pytest.raises(ConfigError, match="ds_overrides"):
        EngineConfig(kind="fsdp", ds_overrides={"zero_optimization": {"stage": 3}}).validate()
    bad = _write(tmp_path, {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match="ds_config: .*remove the 'optimizer' section"):
        EngineConfig(kind="deepspeed", ds_config=str(bad)).validate()


def test_engine_config_through_the_config_system(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text(f"engine:\n  kind: deepspeed\n  ds_config: {CONFIGS['ds_zero3']}\n")
    cfg = load_config(_Run, y, ["engine.ds_overrides.zero_optimization.stage3_param_persistence_threshold=0",
                                "engine.activation_checkpointing=true"])
    assert cfg.engine.ds_overrides == {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    assert cfg.engine.activation_checkpointing is True
    with pytest.raises(ConfigError, match="engine.ds_config"):
        load_config(_Run, None, ["engine.kind=fsdp", f"engine.ds_config={CONFIGS['ds_zero3']}"])
    with pytest.raises(ConfigError, match="engine.kind"):
        load_config(_Run, None, ["engine.kind=zero3"])


def test_parse_launcher_args():
    la, rest = parse_launcher_args(["--local_rank=1", "--ds_config", "configs/ds_zero3.json", "train.steps=5"])
    assert (la.ds_config, rest) == ("configs/ds_zero3.json", ["train.steps=5"])
    assert la.overrides() == ["engine.kind=deepspeed", "engine.ds_config=configs/ds_zero3.json"]
    la, rest = parse_launcher_args(["--deepspeed_config=a.json", "--local-rank", "0", "x=1"])
    assert (la.ds_config, rest) == ("a.json", ["x=1"])
    la, rest = parse_launcher_args(["--deepspeed", "--deepspeed_config", "b.json"])
    assert (la.ds_config, rest) == ("b.json", [])
    la, rest = parse_launcher_args(["--deepspeed", "c.json"])
    assert la.ds_config == "c.json"
    assert parse_launcher_args(["train.steps=3"]) == (type(la)(), ["train.steps=3"])
    with pytest.raises(ConfigError, match="two different DeepSpeed configs"):
        parse_launcher_args(["--ds_config", "a.json", "--deepspeed_config", "b.json"])


# ---------------------------------------------------------------------------------------------------- build


def test_build_plain_engine_and_errors():
    from s2t2_dist.engines.torch_engine import TorchEngine

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model, eng = build_model_and_engine(EngineConfig(), m, OptimConfig(lr=1e-3, weight_decay=0.01),
                                        TrainConfig(steps=10))
    assert model is m and isinstance(eng, TorchEngine) and eng.lr() == pytest.approx(1e-3 / 2)  # warm-up step 1 of 2
    assert [g["weight_decay"] for g in eng.optimizer.param_groups] == [0.01, 0.0]
    with pytest.raises(ConfigError, match="not a registered engine kind"):
        engine_kind("zero")
    with pytest.raises(ConfigError, match="needs a DeepSpeed JSON config"):
        build_model_and_engine(EngineConfig(kind="deepspeed"), m, OptimConfig(), TrainConfig())
    with pytest.raises(ConfigError, match="engine.kind=fsdp"):
        build_model_and_engine(EngineConfig(kind="fsdp", ds_config=str(CONFIGS["ds_zero3"])), m, OptimConfig(),
                               TrainConfig())
    with pytest.raises(ConfigError, match="needs a transformers model"):  # the one activation-checkpointing setup
        build_model_and_engine(EngineConfig(activation_checkpointing=True), m, OptimConfig(), TrainConfig())


def test_engine_kinds_decide_autocast_and_distributed_start():
    """The decisions a stage used to branch on are the kinds' methods: one autocast rule (plain autocasts to bf16
    whenever the run computes in bf16, on CPU too; the sharded engines do bf16 themselves)."""
    assert engine_kind("plain").autocast(torch.bfloat16) == torch.bfloat16
    assert engine_kind("plain").autocast(torch.float32) is None
    for kind in ("deepspeed", "fsdp"):
        assert engine_kind(kind).autocast(torch.bfloat16) is None
        assert type(engine_kind(kind)).init_distributed is not type(engine_kind("plain")).init_distributed


def test_a_new_optimizer_is_one_registered_function():
    from s2t2_dist.config import config_from_dict
    from s2t2_dist.train.optim import OPTIMIZERS, register

    @register("sgd_test")
    def sgd(groups, cfg, fused):  # no fused kernel: TorchEngine then checks the step on the host
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.betas[0])

    try:
        cfg = config_from_dict(OptimConfig, {"name": "sgd_test", "lr": 0.5, "weight_decay": 0.1})
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        _, eng = build_model_and_engine(EngineConfig(), m, cfg, TrainConfig(steps=4))
        assert isinstance(eng.optimizer, torch.optim.SGD) and eng.optimizer.defaults["momentum"] == 0.9
        assert [g["weight_decay"] for g in eng.optimizer.param_groups] == [0.1, 0.0]
        assert cfg.fingerprint()["name"] == "sgd_test" and "name" not in OptimConfig().fingerprint()
    finally:
        del OPTIMIZERS["sgd_test"]
    with pytest.raises(ConfigError, match="name: 'sgd_test' is not a registered optimiser; choose from adamw"):
        config_from_dict(OptimConfig, {"name": "sgd_test"})


def test_weight_decay_groups_use_zero3_shapes():
    w, b = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    w.ds_shape, b.ds_shape = torch.Size([8, 4]), torch.Size([8])  # what ZeRO-3 leaves on a partitioned parameter
    groups = param_groups([w, b], 0.1)
    assert groups[0]["params"] == [w] and groups[0]["weight_decay"] == 0.1
    assert groups[1]["params"] == [b] and groups[1]["weight_decay"] == 0.0
    opt = OptimConfig(lr=1e-3, weight_decay=0.1).build(groups)
    assert opt.defaults["eps"] == 1e-5 and opt.defaults["betas"] == (0.9, 0.95)


def test_build_model_and_engine_plain_from_config():
    from tests.helpers.engines_tiny import tiny_olmo_config

    from s2t2_dist.engines.build import build_model_and_engine
    from s2t2_dist.engines.torch_engine import TorchEngine

    model, eng = build_model_and_engine(EngineConfig(), tiny_olmo_config(tie=False), OptimConfig(), TrainConfig(steps=5))
    assert isinstance(eng, TorchEngine) and eng.module is model and eng.device == torch.device("cpu")
    assert type(model).__name__ == "OlmoForCausalLM"
