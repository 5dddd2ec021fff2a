"""Tiny OLMo models from the real (shipped) configs, the real OLMo tokenizer, E/L extraction and source-token ids."""

import json

import pytest
import torch

from s2t2_dist.models.hf import asset_path, get_embedding_and_head, load_causal_lm
from s2t2_dist.data.tokenizers import load_hf_tokenizer, source_token_ids, token_bytes
from s2t2_dist.recipes.tiny import real_config_dict, save_tiny, tiny_config, tiny_from_config

OLMO_REAL_TOKENS = 50280
OLMO_ROWS = 50304


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "olmo-1b": save_tiny(root / "olmo-1b", "olmo-1b", seed=1),
        "olmo-7b": save_tiny(root / "olmo-7b", "allenai/OLMo-7B-hf", seed=2),
    }


@pytest.fixture(scope="module")
def olmo_tok(tiny_dirs):
    return load_hf_tokenizer(tiny_dirs["olmo-1b"])


def test_shipped_configs_are_the_real_ones():
    c1, c7 = real_config_dict("olmo-1b"), real_config_dict("OLMo-7B")
    assert "_note" not in c1 and "_note" not in c7
    assert (c1["hidden_size"], c1["num_hidden_layers"], c1["intermediate_size"], c1["tie_word_embeddings"]) == (
        2048, 16, 8192, True)
    assert (c7["hidden_size"], c7["num_hidden_layers"], c7["intermediate_size"], c7["tie_word_embeddings"]) == (
        4096, 32, 11008, False)
    for c in (c1, c7):
        assert c["model_type"] == "olmo" and c["vocab_size"] == OLMO_ROWS
        assert c["eos_token_id"] == 50279 and c["pad_token_id"] == 1
    # the real (full-size) config builds as a transformers OlmoConfig with the real values
    full = tiny_config("olmo-7b", n_layers=32, d_model=4096, n_heads=32, intermediate=11008)
    assert type(full).__name__ == "OlmoConfig" and full.num_key_value_heads == 32
    for licence in ("LICENSE", "SOURCES"):
        assert asset_path("olmo", licence).stat().st_size > 500


@pytest.mark.parametrize("name,tied", [("olmo-1b", True), ("olmo-7b", False)])
def test_tiny_save_reload_from_pretrained(tiny_dirs, name, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_dirs[name]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["OlmoForCausalLM"] and cfg["model_type"] == "olmo"
    assert cfg["tie_word_embeddings"] is tied and cfg["vocab_size"] == OLMO_ROWS
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (2, 64, 4)
    assert cfg["intermediate_size"] == (256 if name == "olmo-1b" else 176)  # real MLP ratio kept (4, 2.6875)
    assert AutoConfig.from_pretrained(path).model_type == "olmo"

    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "OlmoForCausalLM"
    E, L, is_tied = get_embedding_and_head(model)
    assert E.shape == L.shape == (OLMO_ROWS, 64)
    assert is_tied is tied
    if not tied:
        assert not torch.equal(E, L)
    # reloading gives the saved weights: same logits as the in-memory model built with the same seed
    fresh = tiny_from_config(name, seed=1 if name == "olmo-1b" else 2)
    ids = torch.tensor([[50279, 510, 3158, 8516]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, fresh(ids).logits, atol=1e-6)
    assert model.generation_config.eos_token_id == 50279  # not the hub's generation_config value 0


def test_load_causal_lm_frozen_and_dtype(tiny_dirs):
    m = load_causal_lm(tiny_dirs["olmo-7b"], dtype="bf16", device="cpu", frozen=True)
    assert all(not p.requires_grad for p in m.parameters()) and not m.training
    assert m.get_input_embeddings().weight.dtype == torch.bfloat16
    m32 = load_causal_lm(tiny_dirs["olmo-1b"])
    assert all(p.requires_grad for p in m32.parameters())
    with pytest.raises(ValueError, match="unknown dtype"):
        load_causal_lm(tiny_dirs["olmo-1b"], dtype="float8")


def test_tiny_is_seeded_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a = tiny_from_config("olmo-1b", vocab=512, seed=3)
    b = tiny_from_config("olmo-1b", vocab=512, seed=3)
    c = tiny_from_config("olmo-1b", vocab=512, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.eos_token_id is None and a.config.pad_token_id == 1  # eos 50279 does not exist in 512 rows


def test_olmo_tokenizer_dir(olmo_tok):
    assert len(olmo_tok) == OLMO_REAL_TOKENS
    assert olmo_tok.eos_token_id == 50279 and olmo_tok.pad_token_id == 1
    assert olmo_tok.convert_ids_to_tokens(0) == "|||IP_ADDRESS|||"
    ids = olmo_tok("MKTAYIAKQR")["input_ids"]
    assert olmo_tok.decode(ids) == "MKTAYIAKQR" and 50279 not in ids  # no BOS/EOS added, as OLMo-hf


def test_source_ids_all_are_the_real_tokens(olmo_tok, tiny_dirs):
    ids = source_token_ids(olmo_tok, "all", num_embeddings=OLMO_ROWS)
    assert ids.dtype == torch.long and ids.numel() == OLMO_REAL_TOKENS
    assert int(ids.max()) < OLMO_REAL_TOKENS  # padding rows 50280..50303 never selected
    assert torch.equal(ids, torch.arange(OLMO_REAL_TOKENS))
    # same from a directory path and from the tokenizer.json file
    assert torch.equal(source_token_ids(tiny_dirs["olmo-1b"]), ids)
    assert torch.equal(source_token_ids(tiny_dirs["olmo-1b"] / "tokenizer.json"), ids)
    no_special = source_token_ids(olmo_tok, "all", exclude_special=True)
    assert no_special.numel() == OLMO_REAL_TOKENS - 2 and 1 not in no_special and 50279 not in no_special
    with pytest.raises(ValueError, match="embedding rows"):
        source_token_ids(olmo_tok, num_embeddings=50000)


def test_source_ids_single_char_and_byte(olmo_tok):
    ids = source_token_ids(olmo_tok, "single_char")
    assert 200 < ids.numel() < 5000
    decoded = olmo_tok.batch_decode([[i] for i in ids.tolist()])
    tb = token_bytes(olmo_tok)
    # one character each, and a whole one: the token's bytes are valid UTF-8 (not a lone byte shown as U+FFFD;
    # token 21478 is the character U+FFFD itself, a legitimate one)
    assert all(len(s) == 1 and s == tb[i].decode("utf-8", errors="strict") for s, i in zip(decoded, ids.tolist()))
    # all printable ASCII characters (and space, newline) are there, protein letters in particular
    for ch in "ACDEFGHIKLMNPQRSTVWY acdefg\n0123456789!~":
        (tid,) = olmo_tok(ch)["input_ids"]
        assert tid in set(ids.tolist()), ch
    assert 50279 not in ids and 1 not in ids
    byte_ids = source_token_ids(olmo_tok, "single_byte")
    assert all(len(tb[i]) == 1 for i in byte_ids.tolist())
    assert len({tb[i] for i in byte_ids.tolist()}) == byte_ids.numel()  # distinct bytes
    assert 200 < byte_ids.numel() <= 256
    # a multi-byte character token is a "char" but not a "byte"
    multi = [i for i in ids.tolist() if len(tb[i]) > 1]
    assert multi and not set(multi) & set(byte_ids.tolist())


def test_source_ids_from_file(olmo_tok, tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("# protein letters\n34\n36 # C\n\n37\n")
    assert source_token_ids(olmo_tok, f).tolist() == [34, 36, 37]
    assert source_token_ids(olmo_tok, f"file:{f}").tolist() == [34, 36, 37]
    f.write_text("34\n50290\n")
    with pytest.raises(ValueError, match=r"ids\.txt:2: id 50290 is not a real token"):
        source_token_ids(olmo_tok, f)
    f.write_text("34\nA\n")
    with pytest.raises(ValueError, match=r"ids\.txt:2: expected one integer"):
        source_token_ids(olmo_tok, f)
    f.write_text("34\n35\n34\n")
    with pytest.raises(ValueError, match=r"ids\.txt:3: id 34 repeated \(first on line 1\)"):
        source_token_ids(olmo_tok, f)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        source_token_ids(olmo_tok, f"file:{tmp_path / 'missing.txt'}")
    with pytest.raises(ValueError, match="unknown source-token rule"):
        source_token_ids(olmo_tok, "bytes")
