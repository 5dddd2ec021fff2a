"""`s2t2 prepare tokenizer_path=...`: an existing tokenizer (an earlier run's BPE, or a model's own) is used as it is
(no training), its hash recorded, and the data split and tokenized with it."""

from __future__ import annotations

import json

import pytest
from tests.helpers.data_files import ESM, MMSEQS, OLMO_TOKENIZER, SHAKESPEARE

from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.data.tokenizers import load_tokenizer, tokenizer_hash
from s2t2_dist.data.config import DataConfig
from s2t2_dist.data.reader import EvalDocs
from s2t2_dist.data.shards import load_manifest
from s2t2_dist.data.split import iter_split_texts
from s2t2_dist.stages import prepare as prepare_stage


def _eval_tokens(out) -> list[list[int]]:
    return [d["input_ids"][1:].tolist() for d in EvalDocs(out / "shards" / "new" / "eval")]


def test_reuse_an_earlier_runs_bpe(tmp_path, capsys):
    a = tmp_path / "a"
    assert prepare_stage.main([f"inputs=[{ESM}]", f"output_dir={a}", "vocab_size=64", "context_len=64",
                               "eval_fraction=0.2", "--no-progress"]) == 0
    b = tmp_path / "b"
    # vocab_size=300 would train a different BPE: with tokenizer_path nothing is trained
    args = [f"inputs=[{MMSEQS}]", f"output_dir={b}", f"tokenizer_path={a / 'tokenizer'}", "vocab_size=300",
            "context_len=64", "eval_fraction=0.05", "--no-progress"]
    assert prepare_stage.main(args) == 0
    out = capsys.readouterr().out
    assert f"adopted from {a / 'tokenizer'}" in out and "not trained" in out
    h = tokenizer_hash(a / "tokenizer")
    assert tokenizer_hash(b / "tokenizer") == h
    summary = json.loads((b / "prepare_summary.json").read_text())
    assert summary["tokenizer"]["hash"] == h and summary["tokenizer"]["vocab_size"] == 64
    assert summary["tokenizer"]["adopted_from"] == str(a / "tokenizer") and summary["tokenizer"]["trained_on"] is None
    for key in ("new/train", "new/eval"):
        assert load_manifest(b / "shards" / key)["tokenizer"]["hash"] == h
    # the eval documents are exactly the adopted tokenizer's encoding of the eval split
    tok = load_tokenizer(a / "tokenizer")
    assert _eval_tokens(b) == tok.encode(list(iter_split_texts(b / "splits", "eval")))
    # the same command again reuses the adopted tokenizer
    assert prepare_stage.main(args) == 0
    again = json.loads((b / "prepare_summary.json").read_text())
    assert again["steps"]["tokenizer"]["reused"] and again["tokenizer"]["hash"] == h


def test_a_models_own_tokenizer_on_english_text(tmp_path):
    out = tmp_path / "p"
    cfg = load_config(DataConfig, None, [f"inputs=[{SHAKESPEARE}]", "domain=text", "text_mode=paragraph",
                                         f"tokenizer_path={OLMO_TOKENIZER}", f"output_dir={out}", "context_len=128",
                                         "eval_fraction=0.1"])
    summary = prepare_stage.run(cfg, progress=False)
    h = tokenizer_hash(OLMO_TOKENIZER)
    assert summary["tokenizer"]["hash"] == h and summary["tokenizer"]["vocab_size"] == 50280
    m = load_manifest(out / "shards" / "new" / "eval")
    assert m["tokenizer"]["hash"] == h and m["tokenizer"]["eos_id"] == 50279
    tok = load_tokenizer(OLMO_TOKENIZER)
    texts = list(iter_split_texts(out / "splits", "eval"))
    assert texts and _eval_tokens(out) == tok.encode(texts)
    comp = summary["tokenizer"]["compression"]["tokenizers"]["new"]
    assert 3.0 < comp["bytes_per_token"] < 6.0  # English with a real English BPE


def test_a_missing_tokenizer_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer_path"):
        load_config(DataConfig, None, [f"inputs=[{ESM}]", f"tokenizer_path={tmp_path / 'none'}"])
