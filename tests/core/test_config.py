from dataclasses import dataclass, field
from typing import Literal

import pytest

from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.train.config import OptimConfig, TrainConfig


@dataclass
class Run:
    name: str = "x"
    kind: Literal["sparse", "softmax"] = "sparse"
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tags: list[str] = field(default_factory=list)
    extra: int | None = None


def test_yaml_and_dotted_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: demo\noptim:\n  lr: 2.0e-5\n  weight_decay: 0.01\ntrain:\n  steps: 7\n")
    cfg = load_config(Run, f, ["train.batch_size=32", "optim.betas=[0.8, 0.9]", "kind=softmax", "tags=a,b",
                               "extra=null", "train.micro_batch_size=8"])
    assert cfg.name == "demo" and cfg.optim.lr == 2e-5 and cfg.optim.weight_decay == 0.01
    assert cfg.train.steps == 7 and cfg.train.batch_size == 32 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.kind == "softmax" and cfg.tags == ["a", "b"] and cfg.extra is None
    assert cfg.train.grad_accum(world_size=2) == 2


def test_unknown_key_names_dotted_path_and_suggests(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*'optim.lrr'.*did you mean 'lr'"):
        load_config(Run, f)
    with pytest.raises(ConfigError, match=r"train.stepz"):
        load_config(Run, None, ["train.stepz=3"])


def test_bad_values_are_refused_with_key():
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer"):
        load_config(Run, None, ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"kind: 'dense' is not one of"):
        load_config(Run, None, ["kind=dense"])
    with pytest.raises(ConfigError, match=r"optim.lr: must be > 0"):
        load_config(Run, None, ["optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"not of the form"):
        load_config(Run, None, ["optim.lr"])


def test_impossible_batch_layout():
    cfg = load_config(Run, None, ["train.batch_size=16", "train.micro_batch_size=3"])
    with pytest.raises(ConfigError, match=r"impossible layout"):
        cfg.train.grad_accum(world_size=2)


def test_missing_file_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml"):
        load_config(Run, tmp_path / "nope.yaml")


def test_yaml_numbers_and_times():
    from s2t2_dist.config import yaml_load

    d = yaml_load("t: 8:00:00\na: 1e-3\nb: 2.0e-5\nc: 12\nd: -3\ne: 1_000\nf: .5\ng: 0x10\nh: 1:30")
    assert d == {"t": "8:00:00", "a": 1e-3, "b": 2e-5, "c": 12, "d": -3, "e": 1000, "f": 0.5, "g": 16, "h": "1:30"}


def test_errors_name_where_the_value_came_from(tmp_path):
    """A bad value set on the command line is named as such, not as the YAML file's; one from the file names it."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: -3\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: train\.steps: must be >= 0") as e:
        load_config(Run, f)
    assert "command line" not in str(e.value)
    f.write_text("train:\n  steps: 7\n")
    with pytest.raises(ConfigError, match=r"^command line train\.steps=-1: train\.steps: must be >= 0") as e:
        load_config(Run, f, ["train.steps=-1"])
    assert "c.yaml" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^command line train\.stepz=3: unknown config key 'train\.stepz'"):
        load_config(Run, f, ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"^command line optim\.lr=-1: optim\.lr: must be > 0"):
        load_config(Run, None, ["optim.lr=-1"])
    assert load_config(Run, f, ["train.steps=0"]).train.steps == 0  # 0: score the start without training
