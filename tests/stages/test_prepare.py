"""The `prepare` stage as users run it: `python launch/prepare.py --config configs/prepare_demo.yaml` and
`s2t2 prepare` (via `python -m s2t2_dist.cli`), on the protein sample shipped with the package."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from tests.helpers.data_files import MMSEQS

from s2t2_dist.config import load_config
from s2t2_dist.data.config import DataConfig
from s2t2_dist.data.shards import load_manifest
from s2t2_dist.stages import prepare as prepare_stage


def run_cli(repo_root, *args):
    env = {**os.environ, "PYTHONPATH": str(repo_root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=repo_root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_prepare_demo_from_the_launch_script_then_rerun_through_the_cli(repo_root, tmp_path):
    out = tmp_path / "demo"
    r = run_cli(repo_root, "launch/prepare.py", "--config", "configs/prepare_demo.yaml", f"output_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokenize train" in r.stderr  # progress bars (stderr), the summary on stdout
    assert "records  read 515, kept 515" in r.stdout
    assert "new     vocab     512" in r.stdout and "source needs" in r.stdout
    assert f"train on: train {out}/shards/new/train" in r.stdout

    summary = json.loads((out / "prepare_summary.json").read_text())
    assert summary["split"]["records_read"] == 515 and summary["tokenizer"]["vocab_size"] == 512
    comp = summary["tokenizer"]["compression"]["tokenizers"]
    assert 1.6 < comp["new"]["vs_bytes"] < 2.1 and comp["new"]["ratio_vs_source"] > 0.9
    for key in ("new/train", "new/eval", "source/train", "source/eval"):
        m = load_manifest(out / "shards" / key, verify_checksums=True)
        assert m["totals"] == {k: v for k, v in summary["shards"][key].items()
                               if k not in ("shards", "shard_bytes", "vocab_size")}
        assert m["context_len"] == 512 and len(m["shards"]) == summary["shards"][key]["shards"] >= 1
    assert load_manifest(out / "shards" / "source" / "eval")["tokenizer"]["vocab_size"] == 50280
    saved = yaml.safe_load((out / "prepare_config.yaml").read_text())  # the config, as given, with every default
    assert saved["vocab_size"] == 512 and saved["output_dir"] == str(out) and saved["min_frequency"] == 2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    seq = MMSEQS.read_text().split("\n", 2)[1]  # first line of the first sequence
    assert len(tok(seq, add_special_tokens=False)["input_ids"]) < len(seq)
    assert tok.decode(tok(seq, add_special_tokens=False)["input_ids"]) == seq

    # the same command again through `s2t2 prepare`: finds everything done and rewrites nothing
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "prepare_config.yaml"
              and p.name != "prepare_summary.json" and p.name != ".s2t2.lock"}  # the lock names its holder
    r2 = run_cli(repo_root, "-m", "s2t2_dist.cli", "prepare", "--config", "configs/prepare_demo.yaml",
                 f"output_dir={out}", "--no-progress")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "everything was already done; nothing was rewritten" in r2.stdout
    assert "tokenize" not in r2.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    again = json.loads((out / "prepare_summary.json").read_text())
    assert again["shards"] == summary["shards"] and all(s["reused"] for s in again["steps"].values())


def test_config_errors_name_the_key_and_exit_2(repo_root, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(repo_root)  # the demo config's paths are relative to the repository root
    rc = prepare_stage.main(["--config", "configs/prepare_demo.yaml", f"output_dir={tmp_path}", "vocab_szie=100"])
    assert rc == 2 and "did you mean 'vocab_size'" in capsys.readouterr().err
    rc = prepare_stage.main(["--config", "configs/prepare_demo.yaml", f"output_dir={tmp_path}", "vocab_size=10"])
    assert rc == 2 and "vocab_size: 10 is smaller than the alphabet" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_non_zero_ranks_do_nothing(repo_root, tmp_path, monkeypatch):
    monkeypatch.chdir(repo_root)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert prepare_stage.main(["--config", "configs/prepare_demo.yaml", f"output_dir={tmp_path / 'o'}"]) == 0
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["prepare_uniref50.yaml", "prepare_text.yaml"])
def test_shipped_production_configs_are_valid(repo_root, name):
    # their inputs are not on this machine: point them at the shipped sample, everything else as written
    cfg = load_config(DataConfig, repo_root / "configs" / name, [f"inputs=[{MMSEQS}]"])
    assert cfg.context_len == 512
    if name == "prepare_uniref50.yaml":
        assert cfg.vocab_size == 512 and cfg.source_tokenizer == "allenai/OLMo-1B-hf"
