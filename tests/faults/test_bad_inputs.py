"""Bad inputs, each through the code a user runs: one error that names the file, key or value that is wrong.

Truncated and corrupted tar shards, manifests that do not match their shards, shards replaced under a running
job, P files of another tokenizer or damaged, mistyped config keys, impossible layouts, a missing DeepSpeed config.
(Checkpoints of another configuration or rank count: test_translate_nan_and_layout.py and
test_checkpoint_faults.py.) Every check also says which fault it injected (docs/reliability.md counts them)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
from tests.helpers.faults_suite import REPO, base_env, ledger, prepare_tiny, translate_args, write_tiny_fasta

from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.errors import ManifestError, ShardError
from s2t2_dist.data.global_loader import GlobalTrainLoader
from s2t2_dist.translator.pfile import load_p, save_p
from s2t2_dist.errors import PFileError
from s2t2_dist.stages.translate import TranslateConfig, run

pytestmark = pytest.mark.faults


@pytest.fixture
def data(tiny_data, tmp_path):
    """A private copy of the prepared tiny data set, free to damage."""
    d = tmp_path / "data"
    shutil.copytree(tiny_data, d)
    return d


def _translate(data, model, run_dir, monkeypatch, *extra):
    monkeypatch.setenv("S2T2_DEVICE", "cpu")
    return run(load_config(TranslateConfig, None, translate_args(data, model, run_dir, *extra)))


def _shards(data):
    return sorted((data / "shards/new/train").glob("*.tar"))


# ------------------------------------------------------------------------------------------------- shards


def test_truncated_shard(data, stories, tmp_path, monkeypatch):
    shard = _shards(data)[2]
    shard.write_bytes(shard.read_bytes()[:5000])
    with pytest.raises(ShardError, match=rf"shard {shard} has 5000 bytes but .*manifest.json says \d+: truncated"):
        _translate(data, stories, tmp_path / "run", monkeypatch, "train.steps=2")
    ledger("bad input: a truncated tar shard")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupted_shard_same_size(data, num_workers):
    shard = _shards(data)[1]
    raw = bytearray(shard.read_bytes())
    raw[512 * 5:512 * 7] = os.urandom(1024)  # the second sample's tar header and data, same size
    shard.write_bytes(bytes(raw))
    loader = GlobalTrainLoader(data / "shards/new/train", global_batch_size=2, micro_batch_size=2,
                               num_workers=num_workers, shuffle_window=16)
    with pytest.raises(ShardError, match=rf"shard {shard}"):
        for _ in loader:
            pass
    ledger("bad input: a corrupted tar shard (same size)")


def test_corrupted_shards_stop_the_stage_naming_the_shard(data, stories, tmp_path, monkeypatch):
    for shard in _shards(data):  # whichever the first batch reads
        raw = bytearray(shard.read_bytes())
        raw[0:512] = os.urandom(512)
        shard.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"shard .*train-00000\d.tar"):
        _translate(data, stories, tmp_path / "run", monkeypatch, "train.steps=2")


def _edit_manifest(data, fn):
    f = data / "shards/new/train/manifest.json"
    m = json.loads(f.read_text())
    fn(m)
    f.write_text(json.dumps(m))
    return f


def test_manifest_does_not_match_the_shards(data):
    train = data / "shards/new/train"
    _edit_manifest(data, lambda m: m["shards"][3].update(n_samples=m["shards"][3]["n_samples"] + 1))
    with pytest.raises(ManifestError, match=r"shard train-000004.tar starts at sample 64, expected 65"):
        GlobalTrainLoader(train, global_batch_size=2, micro_batch_size=2)
    ledger("bad input: a manifest whose sample counts do not match the shards")


def test_manifest_lists_a_missing_shard(data):
    _shards(data)[4].unlink()
    with pytest.raises(ShardError, match=r"shard .*train-000004.tar is missing \(listed in .*manifest.json\)"):
        GlobalTrainLoader(data / "shards/new/train", global_batch_size=2, micro_batch_size=2)
    ledger("bad input: a manifest listing a missing shard")


def test_manifest_not_json(data):
    (data / "shards/new/train/manifest.json").write_text('{"format": "s2t2-shards", ')
    with pytest.raises(ManifestError, match=r"manifest.json: not valid JSON"):
        GlobalTrainLoader(data / "shards/new/train", global_batch_size=2, micro_batch_size=2)
    ledger("bad input: a corrupt manifest.json")


def test_shards_replaced_under_a_resumed_run(data, stories, tmp_path, monkeypatch):
    """The same path, other shards (re-prepared with another shard size): resuming mid-epoch is refused."""
    run_dir = tmp_path / "run"
    _translate(data, stories, run_dir, monkeypatch, "train.steps=6", "train.stop_after=2")
    shutil.rmtree(data)
    prepare_tiny(data, write_tiny_fasta(tmp_path / "tiny.fasta"), shard_size=8)
    with pytest.raises(ManifestError, match=r"loader state was saved for other shards \(manifest [0-9a-f]+\), not "):
        _translate(data, stories, run_dir, monkeypatch, "train.steps=6")
    ledger("bad input: shards replaced under a resumed run (manifest differs)")


def test_context_len_of_the_shards_differs(data, stories, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"train.context_len=32 but the shards in .* hold blocks of 64 tokens"):
        _translate(data, stories, tmp_path / "run", monkeypatch, "train.steps=2", "train.context_len=32")
    ledger("bad input: train.context_len differs from the shards'")


# ------------------------------------------------------------------------------------------------- P files


def test_p_file_of_another_tokenizer(stage1_p, data, stories, tmp_path, monkeypatch):
    p = load_p(stage1_p)
    other = save_p(tmp_path / "P_other.safetensors", dataclasses.replace(p, target_tokenizer_hash="0" * 64))
    with pytest.raises(PFileError, match=r"P_other.safetensors: P was learned for a different target tokenizer: "
                                         r"P file has target tokenizer hash 0{64}, this run's target tokenizer has"):
        _translate(data, stories, tmp_path / "run", monkeypatch, "train.steps=2", f"translator.init_p={other}")
    # stage 2 checks the same before building anything
    from s2t2_dist.stages.init_model import InitConfig, resolve_plan

    with pytest.raises(PFileError, match=r"different target tokenizer"):
        resolve_plan(InitConfig(kind="translated", p_file=str(other)), str(stories), str(data / "tokenizer"),
                     tmp_path / "init")
    src = save_p(tmp_path / "P_src.safetensors", dataclasses.replace(p, source_tokenizer_hash="1" * 64))
    with pytest.raises(PFileError, match=r"different source tokenizer"):
        resolve_plan(InitConfig(kind="translated", p_file=str(src)), str(stories), str(data / "tokenizer"),
                     tmp_path / "init")
    ledger("bad input: a P file of another tokenizer (stage 1 init_p, stage 2 init)", count=3)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['S2T2_EVIL_MARK']}",))


def test_damaged_or_pickled_p_file(stage1_p, tmp_path, monkeypatch):
    truncated = tmp_path / "P_trunc.safetensors"
    truncated.write_bytes(stage1_p.read_bytes()[:300])
    with pytest.raises(PFileError, match=r"P_trunc.safetensors: not a readable safetensors file"):
        load_p(truncated)
    mark = tmp_path / "code_ran"
    monkeypatch.setenv("S2T2_EVIL_MARK", str(mark))
    evil = tmp_path / "P_evil.safetensors"
    evil.write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(PFileError, match=r"not a readable safetensors file"):
        load_p(evil)
    assert not mark.exists()
    ledger("bad input: a truncated P file / a pickle posing as a P file (refused, no code run)", count=2)


# ------------------------------------------------------------------------------------------------- config


def test_mistyped_config_keys_name_the_key_and_a_suggestion(tmp_path):
    from s2t2_dist.stages.finetune import parse_config

    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz' \(did you mean 'steps'\?\)"):
        load_config(TranslateConfig, REPO / "configs/translate_olmo1b.yaml", ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'"):
        parse_config(["--config", str(REPO / "configs/finetune_olmo1b.yaml"), "optim.learning_rate=1e-4"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 10\n  batchsize: 4\n")
    with pytest.raises(ConfigError, match=rf"{bad}: unknown config key 'train.batchsize' \(did you mean "
                                          r"'batch_size'\?\)"):
        load_config(TranslateConfig, bad)
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer, got 'ten'"):
        load_config(TranslateConfig, None, ["train.steps=ten", "model.path=x", "data.train=x", "data.tokenizer=x"])
    ledger("bad input: unknown / mistyped config keys and values", count=4)


def test_config_error_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    """What a user sees: no traceback, the key and a suggestion, exit code 2."""
    r = subprocess.run([sys.executable, str(REPO / "launch/translate.py"), "--config", "configs/translate_olmo1b.yaml",
                        "train.stpes=3"], cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    # the key came from the command line, not from the YAML file: the message says so
    assert errors == ["s2t2 translate: error: ConfigError: command line train.stpes=3: unknown config key "
                      "'train.stpes' (did you mean 'steps'?); known keys of this section: " + errors[0].split(
                          "known keys of this section: ")[1]], r.stderr
    assert "Traceback" not in r.stderr
    ledger("bad input: a mistyped key on the command line (one line, exit 2)")


def test_impossible_parallel_layout(data, stories, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"train.batch_size=6 is not a multiple of micro_batch_size x ranks = 4 x 1"):
        _translate(data, stories, tmp_path / "run", monkeypatch, "train.steps=2", "train.batch_size=6",
                   "train.micro_batch_size=4")
    from s2t2_dist.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"impossible layout"):
        TrainConfig(batch_size=16, micro_batch_size=2).grad_accum(3)  # 16 sequences over 3 ranks x 2
    from s2t2_dist.stages.finetune import parse_config

    with pytest.raises(ConfigError, match=r"engine.ds_config: configs/ds_zero3.json is a DeepSpeed config but "
                                          r"engine.kind=fsdp"):
        parse_config(["--config", str(REPO / "configs/finetune_olmo1b.yaml"), "engine.kind=fsdp",
                            "engine.ds_config=configs/ds_zero3.json"])
    ledger("bad input: an impossible parallel layout", count=3)


def test_missing_deepspeed_config(tmp_path, monkeypatch):
    from s2t2_dist.stages.finetune import parse_config

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=r"engine.ds_config: engine.kind=deepspeed needs a DeepSpeed JSON config"):
        parse_config(["--config", "configs/finetune_olmo1b.yaml", "engine.ds_config=null"])
    with pytest.raises(ConfigError, match=rf"DeepSpeed config file not found: {tmp_path}/nope.json"):
        parse_config(["--config", "configs/finetune_olmo1b.yaml", "--ds_config", f"{tmp_path}/nope.json"])
    broken = tmp_path / "ds.json"
    broken.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ConfigError, match=rf"DeepSpeed config {broken}: not valid JSON"):
        parse_config(["--config", "configs/finetune_olmo1b.yaml", "--ds_config", str(broken)])
    ledger("bad input: a missing / unreadable DeepSpeed config", count=3)
