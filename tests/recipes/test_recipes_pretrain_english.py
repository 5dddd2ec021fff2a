"""The byte-level English source-LM recipe: trains (loss falls), caches by config+data hash, reloads with Auto*."""

import gzip
import json
import os
from pathlib import Path

import pytest
import torch

from s2t2_dist.models.hf import asset_path
from s2t2_dist.data.tokenizers import source_token_ids
from s2t2_dist.recipes.pretrain_english import (
    EnglishLMConfig,
    N_REAL_TOKENS,
    byte_stream,
    config_hash,
    main,
    pretrain_english,
)


def _english(tmp_path):
    """Real English text: tinyshakespeare when the workplace's shared data is there, else the shipped licence."""
    for p in Path(__file__).resolve().parents:
        f = p / "shared" / "data" / "english" / "tinyshakespeare_input.txt"
        if f.is_file() and not os.environ.get("S2T2_TEST_NO_SHARED_DATA"):
            return f
    return asset_path("olmo", "LICENSE")


@pytest.fixture
def cfg(tmp_path):
    text = _english(tmp_path).read_text()
    jl = tmp_path / "docs.jsonl.gz"
    with gzip.open(jl, "wt", encoding="utf-8") as f:
        for para in text.split("\n\n")[:40]:
            f.write(json.dumps({"text": para, "url": "x"}) + "\n")
    txt = tmp_path / "slice.txt"
    txt.write_text(text[:20000])
    return EnglishLMConfig(
        data=[str(txt), str(jl)], n_layers=1, d_model=32, n_heads=2, context_len=64, batch_size=8,
        steps=40, lr=3e-3, warmup=5, eval_batches=2,
    )


def test_stream_reads_txt_and_jsonl(cfg):
    s = byte_stream(cfg)
    assert s.dtype == torch.long and int(s.max()) <= 256
    n_records = sum(1 for _ in gzip.open(cfg.data[1], "rt"))
    assert int((s == 256).sum()) == 1 + n_records  # every document ends with <|endoftext|>
    first = Path(cfg.data[0]).read_bytes()[:100]
    assert bytes(s[:100].tolist()) == first


def test_pretrain_loss_falls_and_cache_reused(cfg, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path / "cache"
    r = pretrain_english(cfg, root, log=None)
    assert not r.reused and r.path.name.startswith("english-bytes-")
    losses = r.info["train_losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # ln(264) = 5.6 -> well below
    assert r.info["val_loss_after"] < r.info["val_loss_before"] - 1.0

    stamp = (r.path / "model.safetensors").stat().st_mtime_ns
    again = pretrain_english(cfg, root, log=None)
    assert again.reused and again.path == r.path
    assert (r.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert list(root.iterdir()) == [r.path]  # no temporary directories left

    tok = AutoTokenizer.from_pretrained(r.path)
    model = AutoModelForCausalLM.from_pretrained(r.path)
    assert type(model).__name__ == "OlmoForCausalLM" and model.config.vocab_size == 264
    text = "Hello, wörld!"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 257, N_REAL_TOKENS)
    assert source_token_ids(tok, "single_byte").tolist() == list(range(256))
    assert source_token_ids(tok, "all", num_embeddings=264).numel() == N_REAL_TOKENS  # padding rows excluded
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert torch.isfinite(loss)


def test_hash_covers_config_and_data(cfg, tmp_path):
    h = config_hash(cfg)
    cfg2 = EnglishLMConfig(**{**cfg.__dict__, "steps": 41})
    assert config_hash(cfg2) != h
    Path(cfg.data[0]).write_text(Path(cfg.data[0]).read_text() + "more")
    assert config_hash(cfg) != h
    with pytest.raises(ValueError, match="at least one"):
        EnglishLMConfig().validate()


def test_cli_entry(cfg, tmp_path, capsys):
    rc = main(["--data", *cfg.data, "--cache-root", str(tmp_path / "c"), "--steps", "2", "--n-layers", "1",
               "--d-model", "16", "--n-heads", "2", "--context-len", "32", "--batch-size", "2", "--eval-batches", "1"])
    assert rc == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((out / "s2t2_recipe.json").read_text())
    assert saved["config"]["steps"] == 2 and saved["config"]["d_model"] == 16
