"""Discoverable configs: every key of every stage's config is described where it is declared (`#:` comments),
`s2t2 <stage> --help` lists them all with type, default and description, and `s2t2 config <stage>` prints the
resolved config (unknown key: one line, exit 2)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from s2t2_dist.cli import main as cli
from s2t2_dist.config import load_config, to_dict, yaml_load
from s2t2_dist.config_docs import STAGE_CONFIGS, config_rows, field_docs, stage_config

REPO = Path(__file__).resolve().parents[2]


def _all_classes(cls, seen=None) -> list[type]:
    seen = [] if seen is None else seen
    if cls not in seen:
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                _all_classes(hints[f.name], seen)
    return seen


@pytest.mark.parametrize("stage", sorted(STAGE_CONFIGS))
def test_every_field_of_every_stage_config_has_a_description(stage):
    missing = []
    for cls in _all_classes(stage_config(stage)):
        docs = field_docs(cls)
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"fields without a `#:` description: {missing}"


@dataclass
class _Inner:
    #: first line
    #: second line
    a: int = 1
    b: str = "x"  # a trailing comment is not a description


@dataclass
class _Outer:
    #: the inner section
    inner: _Inner = field(default_factory=lambda: _Inner(a=5))
    #: a choice
    kind: typing.Literal["p", "q"] = "q"
    #: optional list
    tags: list[str] | None = None


def test_rows_join_comment_blocks_and_take_defaults_from_the_parent():
    rows = {r.key: r for r in config_rows(_Outer)}
    assert rows["inner"].type == "section" and rows["inner"].doc == "the inner section"
    a = rows["inner.a"]
    assert (a.type, a.default, a.doc) == ("int", "5", "first line second line")
    assert rows["inner.b"].doc == ""  # only `#:` blocks count: the check above would catch it
    assert (rows["kind"].type, rows["kind"].default) == ("{p,q}", '"q"')
    assert (rows["tags"].type, rows["tags"].default) == ("list[str] | null", "null")


@pytest.mark.parametrize("stage", sorted(STAGE_CONFIGS))
def test_help_lists_every_key_with_type_default_and_description(stage, capsys):
    with pytest.raises(SystemExit) as e:
        cli([stage, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    rows = [r for r in config_rows(stage_config(stage)) if r.type != "section"]
    assert len(rows) >= 6
    for r in rows:
        assert f"  {r.key}: {r.type} = {r.default}\n      {r.doc}\n" in out + "\n", r.key


def test_config_prints_the_resolved_config(capsys):
    cfg_file = REPO / "configs" / "finetune_olmo1b.yaml"
    overrides = ["train.steps=7", "optim.lr=3e-5", "engine.kind=fsdp"]
    assert cli(["config", "finetune", "--config", str(cfg_file), *overrides]) == 0
    out, err = capsys.readouterr()
    printed = yaml_load(out)
    assert printed["train"]["steps"] == 7 and printed["optim"]["lr"] == 3e-5 and printed["engine"]["kind"] == "fsdp"
    # everything else is the file's value or the default, exactly as the stage resolves it (the YAML's DeepSpeed
    # config dropped by engine.kind=fsdp, as `s2t2 finetune` does)
    from s2t2_dist.engines.launcher import engine_overrides
    from s2t2_dist.stages.finetune import FinetuneConfig

    assert printed == to_dict(load_config(FinetuneConfig, cfg_file, engine_overrides(overrides), validate=False))
    assert printed["engine"]["ds_config"] is None
    file_values = yaml_load(cfg_file.read_text())
    assert printed["model"]["path"] == file_values["model"]["path"]


def test_config_with_no_file_prints_defaults_and_says_what_the_stage_would_refuse(capsys):
    assert cli(["config", "evaluate"]) == 0
    out, err = capsys.readouterr()
    printed = yaml_load(out)
    assert printed["init"]["kind"] == "as_is" and printed["eval"]["context_len"] == 512
    assert "would refuse" in err and "model.path" in err and len(err.strip().splitlines()) == 1


def test_config_unknown_key_is_one_line_exit_2(capsys):
    assert cli(["config", "translate", "translator.alpah=0.1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "translator.alpah" in err and "did you mean 'alpha'" in err
    assert cli(["config", "prepare", "vocab_size=many"]) == 2
    assert "vocab_size" in capsys.readouterr().err


@pytest.mark.parametrize("stage", sorted(STAGE_CONFIGS))
def test_printed_config_loads_back_as_the_same_config(stage, tmp_path, capsys):
    """What `s2t2 config` prints is a complete config file: fed back with --config it resolves to itself."""
    assert cli(["config", stage]) == 0
    first = capsys.readouterr().out
    (tmp_path / "c.yaml").write_text(first)
    assert cli(["config", stage, "--config", str(tmp_path / "c.yaml")]) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves(path, capsys):
    """Every YAML file in configs/ uses only known keys of its stage (named by the file's prefix)."""
    stage = path.name.split("_")[0]
    assert cli(["config", stage, "--config", str(path)]) == 0
    assert yaml_load(capsys.readouterr().out)


def test_config_says_what_auto_and_lr_from_mean(capsys):
    """`auto` values and the resolved block's `lr_from` come with their rule, not as bare words."""
    cfg = str(REPO / "configs" / "translate_olmo1b.yaml")
    assert cli(["config", "translate", "--config", cfg]) == 0
    out = capsys.readouterr().out
    auto = out.partition("# auto (decided when the run starts):\n")[2].partition("# resolved")[0]
    assert "#   train.micro_batch_size: " in auto and "largest divisor" in auto  # the key's own help
    assert "#   train.precision: " in auto and "train.steps" not in auto  # only the keys set to auto
    assert "#   lr_from: auto (optim.lr null, so the automatic step of the kind)" in out
    assert cli(["config", "translate", "--config", cfg, "optim.lr=1e-4"]) == 0
    assert "#   lr_from: given (optim.lr, absolute)" in capsys.readouterr().out


def test_config_of_a_value_the_stage_refuses_is_one_line_not_a_traceback(capsys):
    # was: a raw ConfigError traceback from resolving the automatic keys of an unknown kind
    assert cli(["config", "translate", "--config", str(REPO / "configs" / "translate_olmo1b.yaml"),
                "translator.kind=Sparse"]) == 0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()]
    assert "would refuse this config: translator.kind: 'Sparse' is not a registered translator kind" in err


def test_config_checks_the_environment_like_the_stages(capsys, monkeypatch):
    monkeypatch.setenv("S2T2_MASTER_PORT", "99999")
    assert cli(["config", "translate"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("s2t2 config: error: EnvError: S2T2_MASTER_PORT='99999': out of range "
                                         "(a port number 1-65535)")
