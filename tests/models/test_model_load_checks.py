"""A model that would load wrong is refused in one line naming the directory: config.json lacking
a field the architecture needs, config.json disagreeing with the weights' depth / width / vocabulary, weights
missing or carrying tensors the model does not use. Real models: the shipped stories260K (5 layers, converted
with its real config) and tiny models of every architecture tests/helpers/arch_fixtures.py knows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from s2t2_dist.errors import ConfigError
from s2t2_dist.models import dir_check
from s2t2_dist.models.hf import load_causal_lm
from s2t2_dist.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[2]
FASTA = REPO / "s2t2_dist" / "assets" / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Path:
    from s2t2_dist.recipes.llama2c import save_hf

    return save_hf(tmp_path_factory.mktemp("m") / "stories260k")


def _edited(src: Path, dst: Path, drop=(), **set_) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k in drop:
        cfg.pop(k)
    cfg.update(set_)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _evaluate(tmp_path: Path, model: Path) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("S2T2_")}
    return subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "evaluate", f"run_dir={tmp_path / 'ev'}",
                           f"model.path={model}", f"data.files=[{FASTA}]", "eval.context_len=64",
                           f"data.cache_dir={tmp_path / 'cache'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": str(REPO), "S2T2_DEVICE": "cpu", "S2T2_LOG_LEVEL": "WARNING"})


def test_the_shipped_model_passes(stories):
    assert json.loads((stories / "config.json").read_text())["num_hidden_layers"] == 5
    dir_check.check(stories)
    load_causal_lm(stories)


@pytest.mark.parametrize("field", ["num_hidden_layers", "vocab_size", "hidden_size", "rms_norm_eps",
                                   "num_attention_heads", "intermediate_size"])
def test_config_lacking_a_field_the_architecture_needs_is_refused(stories, tmp_path, field):
    m = _edited(stories, tmp_path / "m", drop=[field])
    with pytest.raises(ConfigError, match=rf"model.path: {m}/config.json lacks {field}, which the llama "):
        dir_check.check(m)


def test_missing_num_hidden_layers_is_one_line_exit_2_not_a_32_layer_model(stories, tmp_path):
    """Before: loaded as 32 layers (27 random), evaluate exited 0 with a wrong perplexity."""
    m = _edited(stories, tmp_path / "m", drop=["num_hidden_layers"])
    p = _evaluate(tmp_path, m)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip() == (f"s2t2 evaluate: error: ConfigError: model.path: {m}/config.json lacks "
                                "num_hidden_layers, which the llama architecture needs (transformers would use its "
                                "class default and load a different model); restore the config.json saved with "
                                "these weights")
    assert not (tmp_path / "ev" / "eval.json").exists()


def test_missing_vocab_size_is_one_line_not_a_traceback(stories, tmp_path):
    m = _edited(stories, tmp_path / "m", drop=["vocab_size"])
    p = _evaluate(tmp_path, m)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "lacks vocab_size" in p.stderr


@pytest.mark.parametrize("edit,says", [
    ({"num_hidden_layers": 3}, "num_hidden_layers=3 but the weights hold 5 layers"),
    ({"num_hidden_layers": 8}, "num_hidden_layers=8 but the weights hold 5 layers"),
    ({"vocab_size": 600}, "vocab_size=600 but the embedding has 512 rows"),
    ({"hidden_size": 128}, "hidden_size=128 but the embedding is 64 wide"),
])
def test_config_that_disagrees_with_the_weights_is_refused_before_loading(stories, tmp_path, edit, says):
    m = _edited(stories, tmp_path / "m", **edit)
    with pytest.raises(ConfigError, match=rf"^model.path: {m}/config.json does not describe the weights beside "
                                          rf"it: {says}"):
        dir_check.check(m)


def _drop_tensor(src: Path, dst: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    del sd[name]
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _add_tensor(src: Path, dst: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd[name] = torch.zeros(3)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_weights_missing_a_tensor_are_refused_after_loading(stories, tmp_path):
    m = _drop_tensor(stories, tmp_path / "m", "model.norm.weight")
    dir_check.check(m)  # shapes and depth agree: only loading finds it
    with pytest.raises(ModelLoadError, match=rf"^model.path {m}: the weights do not match config.json: 1 tensors "
                                             r"the model needs are not in the weights \(model.norm.weight\)"):
        load_causal_lm(m)
    m2 = _drop_tensor(stories, tmp_path / "m2", "model.layers.3.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"\(model.layers.3 \(1 tensors\)\)"):
        load_causal_lm(m2)


def test_weights_with_a_tensor_the_model_does_not_use_are_refused(stories, tmp_path):
    m = _add_tensor(stories, tmp_path / "m", "model.extra_norm.weight")
    with pytest.raises(ModelLoadError, match=r"1 tensors of the weights are not used by the model "
                                             r"\(model.extra_norm.weight\)"):
        load_causal_lm(m)


def test_weights_missing_a_tensor_through_the_command(stories, tmp_path):
    m = _drop_tensor(stories, tmp_path / "m", "model.norm.weight")
    p = _evaluate(tmp_path, m)
    assert p.returncode == 2, p.stderr[-3000:]
    line = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
    assert line == [f"s2t2 evaluate: error: ModelLoadError: model.path {m}: the weights do not match config.json: "
                    "1 tensors the model needs are not in the weights (model.norm.weight); the model would run with "
                    "random parts (is config.json the one saved with these weights?)"], p.stderr[-3000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("tied", [True, False])
def test_every_fixture_architecture_passes_both_checks(tmp_path, tied):
    """No false refusal: real configs of llama, olmo, olmo2, qwen2, mistral, gemma, gpt_neox, gpt2, tied or not."""
    from tests.helpers.arch_fixtures import _configs
    from transformers import AutoModelForCausalLM

    for arch, make in _configs().items():
        cfg = make()
        cfg.tie_word_embeddings = tied
        out = tmp_path / f"{arch}_{tied}"
        AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
        dir_check.check(out)
        load_causal_lm(out)
        c = json.loads((out / "config.json").read_text())
        layers = "n_layer" if arch == "gpt2" else "num_hidden_layers"
        c.pop(layers)
        (out / "config.json").write_text(json.dumps(c))
        with pytest.raises(ConfigError, match=f"lacks {layers}"):
            dir_check.check(out)


def test_a_tokenizer_json_of_another_format_version_is_one_line(tmp_path, stories):
    from s2t2_dist.data.tokenizers import load_tokenizer
    from s2t2_dist.errors import DataError

    tj = json.loads((stories / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps({**tj, "version": "2.0"}))
    with pytest.raises(DataError, match=rf"^{tmp_path}/tokenizer.json: not a tokenizer file that tokenizers "
                                        r"\S+ can read \(Unknown tokenizer version '2.0'"):
        load_tokenizer(tmp_path)
