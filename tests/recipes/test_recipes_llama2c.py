"""llama2.c stories260K + tok512 -> transformers Llama + tokenizers BPE, checked against independent references:

- the documented greedy sample ("Once upon a time, there was a little girl named Lily");
- a from-scratch re-implementation of run.c's forward pass (interleaved RoPE, GQA, SwiGLU) on the raw arrays;
- a from-scratch re-implementation of run.c's encode()/decode() on the raw tok512.bin entries.
"""

import math
import os
import struct
from pathlib import Path

import pytest
import torch

from s2t2_dist.recipes import llama2c
from s2t2_dist.models.hf import asset_path, get_embedding_and_head
from s2t2_dist.data.tokenizers import source_token_ids

EXPECTED = "Once upon a time, there was a little girl named Lily"


def _shared_data():
    if os.environ.get("S2T2_TEST_NO_SHARED_DATA"):  # emulate a user's machine (no workplace data)
        return None
    for p in Path(__file__).resolve().parents:
        if (p / "shared" / "data").is_dir():
            return p / "shared" / "data"
    return None


@pytest.fixture(scope="module")
def raw():
    return llama2c.read_llama2c_checkpoint(llama2c.default_checkpoint())


@pytest.fixture(scope="module")
def model():
    return llama2c.load_llama2c()


@pytest.fixture(scope="module")
def tok():
    return llama2c.llama2c_hf_tokenizer()


@pytest.fixture(scope="module")
def vocab():
    tokens, scores, _ = llama2c.read_llama2c_tokenizer(llama2c.default_tokenizer())
    return tokens, scores


# --- independent references (written from the llama2.c formats, not from the converter) -----------------------


def runc_encode(text: str, tokens: list, scores: list, bos: bool = True) -> list:
    """run.c encode(): dummy-prefix space, one token per UTF-8 character (else byte fallback id = byte + 3), then
    merge the adjacent pair whose concatenation has the highest score, leftmost first, until none is in vocab."""
    index = {t: i for i, t in enumerate(tokens)}
    ids = [1] if bos else []
    if text:
        ids.append(index[b" "])
    data = text.encode("utf-8")
    i = 0
    while i < len(data):
        j = i + 1
        while j < len(data) and (data[j] & 0xC0) == 0x80 and j - i < 4:
            j += 1
        ch = data[i:j]
        ids.extend([index[ch]] if ch in index else [b + 3 for b in ch])
        i = j
    while True:
        best = None
        for k in range(len(ids) - 1):
            m = index.get(tokens[ids[k]] + tokens[ids[k + 1]])
            if m is not None and (best is None or scores[m] > best[0]):
                best = (scores[m], m, k)
        if best is None:
            return ids
        _, m, k = best
        ids[k: k + 2] = [m]


def runc_decode(ids: list, tokens: list) -> str:
    out, prev = b"", None
    for t in ids:
        if t == 1:
            prev = t
            continue
        piece = tokens[t]
        if prev == 1 and piece.startswith(b" "):
            piece = piece[1:]
        if piece.startswith(b"<0x") and len(piece) == 6:
            piece = bytes([int(piece[3:5], 16)])
        out += piece
        prev = t
    return out.decode("utf-8", errors="replace")


def runc_forward(h, w, ids: list) -> torch.Tensor:
    """Logits [T, V] for a token sequence, computed as run.c does position by position (vectorised over T)."""
    hs, T = h.head_size, len(ids)
    rep = h.n_heads // h.n_kv_heads

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * g

    def rope(x):  # x [T, heads, hs]: rotate pairs (2i, 2i+1) by pos * 10000^(-2i/hs)
        pos = torch.arange(T, dtype=torch.float64)[:, None]
        freq = 1.0 / (10000.0 ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
        ang = (pos * freq)[:, None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    W = {k: v.double() for k, v in w.items()}
    x = W["token_embedding_table"][ids]
    causal = torch.ones(T, T).tril().bool()
    for l in range(h.n_layers):
        xb = rms(x, W["rms_att_weight"][l])
        q = rope((xb @ W["wq"][l].T).view(T, h.n_heads, hs))
        k = rope((xb @ W["wk"][l].T).view(T, h.n_kv_heads, hs))
        v = (xb @ W["wv"][l].T).view(T, h.n_kv_heads, hs)
        heads = []
        for hh in range(h.n_heads):
            kv = hh // rep
            att = (q[:, hh] @ k[:, kv].T) / math.sqrt(hs)
            att = att.masked_fill(~causal, float("-inf")).softmax(-1)
            heads.append(att @ v[:, kv])
        x = x + torch.cat(heads, -1) @ W["wo"][l].T
        xb = rms(x, W["rms_ffn_weight"][l])
        a = xb @ W["w1"][l].T
        x = x + ((a * torch.sigmoid(a)) * (xb @ W["w3"][l].T)) @ W["w2"][l].T
    return rms(x, W["rms_final_weight"]) @ W["wcls"].T


# --- tests ---------------------------------------------------------------------------------------------------------


def test_header_and_layout(raw):
    h, w = raw
    assert (h.dim, h.hidden_dim, h.n_layers, h.n_heads, h.n_kv_heads, h.vocab_size, h.seq_len) == (
        64, 172, 5, 8, 4, 512, 512)
    assert h.shared_classifier and w["wcls"] is w["token_embedding_table"]
    assert w["wq"].shape == (5, 64, 64) and w["wk"].shape == (5, 32, 64) and w["w2"].shape == (5, 64, 172)
    # RMSNorm gains of a trained model are O(1), unlike matrix entries: a misaligned read would not look like this
    assert 0.2 < float(w["rms_final_weight"].abs().mean()) < 20
    for name in ("LICENSE", "SOURCES"):
        assert asset_path("source_lm", name).stat().st_size > 500


def test_greedy_sample_from_bos(model, tok):
    out = model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith(EXPECTED), text
    assert out[0, 0] == 1 and model.config.tie_word_embeddings
    E, L, tied = get_embedding_and_head(model)
    assert tied and E.shape == (512, 64)


def test_logits_match_runc_reference(raw, model, vocab):
    h, w = raw
    ids = runc_encode("Once upon a time, Lily saw a big red ball in the park.", *vocab)
    ref = runc_forward(h, w, ids)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].double()
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=2e-4), float((got - ref).abs().max())


def test_rotary_permutation_is_needed(raw, model):
    """Without the interleaved -> rotate-half permutation of q/k the HF model computes something else."""
    from transformers import LlamaForCausalLM

    h, w = raw
    sd = llama2c.hf_state_dict(h, w)
    for i in range(h.n_layers):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = w["wq"][i].contiguous()
        sd[f"model.layers.{i}.self_attn.k_proj.weight"] = w["wk"][i].contiguous()
    wrong = LlamaForCausalLM(llama2c.llama2c_config(h))
    wrong.load_state_dict(sd, strict=False)
    wrong.tie_weights()
    ids = torch.tensor([[1, 403, 407, 261, 378, 432, 383]])
    with torch.no_grad():
        assert (wrong(ids).logits - model(ids).logits).abs().max() > 1e-2


def _texts():
    texts = [
        "", "Once upon a time", "Once upon a time, there was a little girl named Lily.", " leading space",
        "two  spaces and\nnewlines\n\nhere", "Tom's dog said: \"Woof!\" (3 times)", "café naïve — “quotes” 🙂 日本語",
        "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVV", "aaaaaaaa", "\t tab",
    ]
    data = _shared_data()
    if data is not None:
        lines = (data / "english" / "tinyshakespeare_input.txt").read_text().splitlines()
        texts += [ln for ln in lines[:2000:10] if ln]
    else:
        texts += asset_path("source_lm", "LICENSE").read_text().splitlines()
    return texts


def test_tokenizer_matches_runc_encode(tok, vocab):
    tokens, scores = vocab
    mismatches = []
    for text in _texts():
        want = runc_encode(text, tokens, scores)
        got = tok(text)["input_ids"]
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, mismatches[:3]
    assert tok("Once upon a time")["input_ids"] == [1, 403, 407, 261, 378]
    # pieces as sentencepiece writes them, specials as llama
    assert tok.convert_ids_to_tokens([1, 2, 0, 3, 403]) == ["<s>", "</s>", "<unk>", "<0x00>", "▁Once"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)


def test_decode_matches_runc_decode(model, tok, vocab):
    tokens, _ = vocab
    out = model.generate(torch.tensor([[1]]), max_new_tokens=60, do_sample=False)[0].tolist()
    assert tok.decode(out, skip_special_tokens=True) == runc_decode(out, tokens)
    for text in _texts()[:30]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text  # lossless: only the dummy prefix is stripped


def test_save_hf_round_trip(tmp_path, model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = llama2c.save_hf(tmp_path / "stories260K")
    m = AutoModelForCausalLM.from_pretrained(out)
    t = AutoTokenizer.from_pretrained(out)
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.tie_word_embeddings
    ids = t("Once upon a time", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(m(ids).logits, model(ids).logits)
    gen = m.generate(torch.tensor([[t.bos_token_id]]), max_new_tokens=20, do_sample=False)
    assert t.decode(gen[0], skip_special_tokens=True).startswith("Once upon a time, there was")
    # source ids: 512 real tokens; single bytes = the 256 fallback tokens + single-ASCII-char pieces
    assert source_token_ids(t).numel() == 512
    sb = source_token_ids(t, "single_byte").tolist()
    assert set(range(3, 259)) <= set(sb) and 1 not in sb


def test_corrupt_files_are_rejected(tmp_path):
    good = llama2c.default_checkpoint().read_bytes()
    bad = tmp_path / "short.bin"
    bad.write_bytes(good[:-4])
    with pytest.raises(ValueError, match="bytes but the header"):
        llama2c.read_llama2c_checkpoint(bad)
    bad.write_bytes(struct.pack("<7i", 64, 172, 5, 7, 4, 512, 512) + good[28:])
    with pytest.raises(ValueError, match="implausible"):
        llama2c.read_llama2c_checkpoint(bad)
    tk = tmp_path / "tok.bin"
    tk.write_bytes(llama2c.default_tokenizer().read_bytes()[:-3])
    with pytest.raises(ValueError, match="token 511"):
        llama2c.read_llama2c_tokenizer(tk)
    with pytest.raises(ValueError, match="511 tokens|token 511"):
        llama2c.read_llama2c_tokenizer(tk, 512)
