"""Every number is checked against the range its consumer takes, in the config check (so `s2t2 config` and the stage
agree), and every path a user gives that is the wrong kind of thing is named as such; messages echo the value given.
Each of these reached torch, a later stage of the run, or a misleading word before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from s2t2_dist.config import load_config
from s2t2_dist.errors import CheckpointError, ConfigError
from tests.helpers.stage_fixtures import REPO, small_inputs

NEEDED = ["model.path=m", "data.train=t", "data.tokenizer=k"]


def _translate(*overrides):
    from s2t2_dist.stages.translate import TranslateConfig

    return load_config(TranslateConfig, None, [*overrides, *NEEDED])


@pytest.mark.parametrize("override,said", [
    ("optim.lr=1e308", "optim.lr: must be > 0 and at most 10 "),  # was: C infinite after step 1, IndexError at step 2
    ("optim.grad_clip=-1", "optim.grad_clip: must be >= 0 (0: no clipping), got -1.0"),  # was: silently no clipping
    ("optim.eps=5", "optim.eps: must be in (0, 1], got 5.0"),
    ("optim.weight_decay=2000", "optim.weight_decay: must be >= 0 with lr x weight_decay < 1"),
    ("train.seed=-1", "train.seed: must be in [0, 4294967295], got -1"),
    ("train.seed=99999999999999999999", "train.seed: must be in [0, 4294967295], got 99999999999999999999"),
    ("train.ckpt_every=-5", "train.ckpt_every: must be >= 0, got -5"),  # was: no value in the message
    ("train.eval_every=-1", "train.eval_every: must be >= 0, got -1"),
    ("train.stop_after=-1", "train.stop_after: must be >= 0, got -1"),
    ("train.log_every=0", "train.log_every: must be > 0, got 0"),
    ("data.shuffle_window=0", "data.shuffle_window: must be >= 1"),  # was: refused by the loader, after the model load
])
def test_translate_numbers_are_checked_in_the_config(override, said):
    with pytest.raises(ConfigError) as e:
        _translate(override)
    assert said in str(e.value), str(e.value)


def test_finetune_grad_clip_and_evaluate_seed_and_counts():
    from s2t2_dist.stages.evaluate import EvaluateConfig
    from s2t2_dist.stages.finetune import FinetuneConfig

    with pytest.raises(ConfigError, match=r"optim.grad_clip: must be >= 0 \(0: no clipping\), got -1.0"):
        load_config(FinetuneConfig, None, ["optim.grad_clip=-1", *NEEDED])
    ev = ["model.path=m", f"data.files=[{REPO / 'README.md'}]"]
    with pytest.raises(ConfigError, match=r"seed: must be in \[0, 4294967295\], got -3"):
        load_config(EvaluateConfig, None, ["seed=-3", *ev], validate=False).validate()
    with pytest.raises(ConfigError, match=r"eval.batch_size: must be >= 1, got 0"):
        load_config(EvaluateConfig, None, ["eval.batch_size=0", *ev])


def test_slurm_counts_echo_the_value():
    from s2t2_dist.cluster.submit import SlurmConfig

    with pytest.raises(ConfigError, match=r"nodes: must be >= 1, got 0"):  # was: "nodes and cpus_per_task must be"
        SlurmConfig(nodes=0).validate()


def test_the_config_command_and_the_stage_agree_on_a_bad_number(capsys):
    from s2t2_dist.cli import main

    assert main(["config", "translate", "--config", str(REPO / "configs" / "translate_olmo1b.yaml"),
                 "optim.lr=1e308"]) == 0
    err = capsys.readouterr().err
    assert "would refuse this config: optim.lr: must be > 0 and at most 10" in err


# ----------------------------------------------------------------------------------------- checked after the update

def test_a_checkpoint_of_another_init_p_file_names_the_key(tmp_path):
    from s2t2_dist.train.checkpoint import Checkpointer, _same_as_hashed

    ours = {"kind": "translated", "p_file": "/runs/b/P.safetensors", "dir": ""}
    theirs = {**ours, "p_file": "/runs/a/P.safetensors"}
    ck = Checkpointer(tmp_path, fingerprint={"init": ours})
    with pytest.raises(CheckpointError, match=r"\(init.p_file: checkpoint='/runs/a/P.safetensors' "
                                              r"run='/runs/b/P.safetensors'\)"):  # was: two hashes
        ck.check_compatible(tmp_path, meta={"world_size": 1, "fingerprint": {"init": theirs}})
    # a checkpoint that recorded the section as a hash (before) still resumes when the settings are the same
    import hashlib
    import json

    old = hashlib.sha256(json.dumps(ours, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert _same_as_hashed(old, ours)
    ck.check_compatible(tmp_path, meta={"world_size": 1, "fingerprint": {"init": old}})
    with pytest.raises(CheckpointError, match="init: checkpoint="):
        ck.check_compatible(tmp_path, meta={"world_size": 1, "fingerprint": {"init": "0123456789abcdef"}})


# ----------------------------------------------------------------------------------- paths of the wrong kind, wording

@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return small_inputs(tmp_path_factory)


def _translate_args(run_dir, model, data, *extra):
    return ["--config", str(REPO / "configs" / "translate_olmo1b.yaml"), f"run_dir={run_dir}", f"model.path={model}",
            "model.source_vocab=all", f"data.train={data}/shards/new/train", f"data.tokenizer={data}/tokenizer",
            "train.context_len=64", "train.batch_size=2", "train.micro_batch_size=2", "translator.heatmap=[8,8]",
            "data.eval=", "train.steps=2", *extra]


def _line(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    return err


@pytest.mark.parametrize("kind", ["directory", "device", "fifo"])
def test_a_p_file_of_the_wrong_kind_is_named_as_such(inputs, tmp_path, capsys, kind):
    from s2t2_dist.stages import translate

    data, model = inputs
    p = {"directory": tmp_path / "pdir", "device": Path("/dev/null"), "fifo": tmp_path / "pipe"}[kind]
    if kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)  # opening it would wait for a writer
    said = {"directory": "a directory", "device": "a character device", "fifo": "a FIFO (named pipe)"}[kind]
    line = _line(capsys, translate.main(_translate_args(tmp_path / "run", model, data, f"translator.init_p={p}")))
    assert line.endswith(f"ConfigError: translator.init_p: P file {p} is {said}, not a file"), line  # was: "does not exist"


def test_a_batch_larger_than_the_data_is_refused_before_the_model_load(inputs, tmp_path, capsys, monkeypatch):
    import json

    from s2t2_dist.stages import translate

    data, model = inputs
    n = json.loads((data / "shards/new/train/manifest.json").read_text())["totals"]["n_samples"]
    loaded = []
    monkeypatch.setattr("s2t2_dist.models.hf.from_pretrained_checked", lambda *a, **k: loaded.append(a))
    bs = 2 * (n // 2 + 1)
    line = _line(capsys, translate.main(_translate_args(tmp_path / "run", model, data, f"train.batch_size={bs}",
                                                        f"train.micro_batch_size={bs}")))
    assert f"train.batch_size={bs} is larger than the {n} training blocks in data.train" in line, line
    assert not loaded and not (tmp_path / "run").exists()


def test_a_run_dir_below_a_file_or_on_a_device_is_named(inputs, tmp_path, capsys):
    from s2t2_dist.stages import translate

    data, model = inputs
    f = tmp_path / "file"
    f.write_text("x")
    line = _line(capsys, translate.main(_translate_args(f / "run", model, data)))
    assert line.endswith(f"run_dir: {f / 'run'} is below {f}, which is a file, not a directory"), line
    line = _line(capsys, translate.main(_translate_args("/dev/null", model, data)))
    assert line.endswith("run_dir: /dev/null is a character device, not a directory"), line


def test_a_full_disk_at_a_checkpoint_is_said_without_torchs_internal_text(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from s2t2_dist.train.checkpoint import Checkpointer

    class Engine:  # fails as torch.save does on a full disk
        def save(self, directory):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))
    monkeypatch.setattr("s2t2_dist.utils.rundir.verify", lambda *a, **k: None)
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tmp_path).save(3, Engine(), {})
    msg = str(e.value)
    assert "enforce fail" not in msg and "unexpected pos" not in msg, msg  # was: torch's text in the line
    assert msg.startswith(f"writing checkpoint {tmp_path}/checkpoints/step_00000003.partial failed on rank 0: the "
                          "write failed -- the disk is full: 0 bytes free"), msg
