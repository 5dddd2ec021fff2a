"""Convert llama2.c legacy checkpoints (`.bin`) and tokenizers (`tok*.bin`) to transformers / tokenizers formats.

Checkpoint (llama2.c "legacy" export, little-endian): a header of 7 int32
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
(vocab_size < 0 means the classifier is NOT shared with the embedding), then float32 arrays in the order run.c maps
them: token embedding [V, dim]; attention RMSNorm weights [n_layers, dim]; wq [n_layers, n_heads*hs, dim];
wk, wv [n_layers, n_kv_heads*hs, dim]; wo [n_layers, dim, n_heads*hs]; FFN RMSNorm weights [n_layers, dim];
w1 [n_layers, hidden, dim]; w2 [n_layers, dim, hidden]; w3 [n_layers, hidden, dim]; final RMSNorm [dim];
two unused RoPE tables [seq_len, hs/2] each; and, only if not shared, the classifier [V, dim]. Matrices are stored
as torch Linear weights ([out, in], row-major).

RoPE: llama2.c (like Meta's reference code) rotates INTERLEAVED pairs (x[2i], x[2i+1]) of each head; transformers'
Llama rotates the two HALVES (x[i], x[i + hs/2]). The q/k projection rows are permuted per head
(rows 0,2,4,...,1,3,5,...) so that the HF model computes exactly the same attention scores.

Tokenizer (llama2.c format): int32 max_token_length, then per token: float32 score, int32 byte length, bytes.
Ids 0/1/2 are <unk>, BOS ("\\n<s>\\n" in the file), EOS ("\\n</s>\\n"); 3..258 are the byte-fallback tokens <0x00>..<0xFF>;
spaces are stored as " " (sentencepiece's "▁"). run.c encodes by: a dummy-prefix space, one token per UTF-8
character (byte-fallback ids byte+3 for characters not in the vocabulary), then repeatedly merging the adjacent pair
whose concatenation is the vocabulary entry with the highest score (leftmost on ties). The converted `tokenizers`
BPE reproduces this with merges ranked by the merged piece's score.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from s2t2_dist.api import asset_path

HEADER = struct.Struct("<7i")
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads


def default_checkpoint() -> Path:
    return asset_path("source_lm", "stories260K.bin")


def default_tokenizer() -> Path:
    return asset_path("source_lm", "tok512.bin")


def read_header(path: str | os.PathLike) -> Llama2cHeader:
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the 28-byte llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = HEADER.unpack(raw)
    h = Llama2cHeader(dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len, vocab > 0)
    bad = [k for k, v in asdict(h).items() if isinstance(v, int) and not isinstance(v, bool) and v <= 0]
    if bad or dim % n_heads or n_heads % n_kv or (dim // n_heads) % 2:
        raise ValueError(f"{path}: implausible llama2.c header {h} (is this a legacy-format llama2.c .bin?)")
    return h


def _layout(h: Llama2cHeader) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each array in file order, run.c's names."""
    hs, L = h.head_size, h.n_layers
    out = [
        ("token_embedding_table", (h.vocab_size, h.dim)),
        ("rms_att_weight", (L, h.dim)),
        ("wq", (L, h.n_heads * hs, h.dim)),
        ("wk", (L, h.n_kv_heads * hs, h.dim)),
        ("wv", (L, h.n_kv_heads * hs, h.dim)),
        ("wo", (L, h.dim, h.n_heads * hs)),
        ("rms_ffn_weight", (L, h.dim)),
        ("w1", (L, h.hidden_dim, h.dim)),
        ("w2", (L, h.dim, h.hidden_dim)),
        ("w3", (L, h.hidden_dim, h.dim)),
        ("rms_final_weight", (h.dim,)),
        ("freq_cis_real", (h.seq_len, hs // 2)),
        ("freq_cis_imag", (h.seq_len, hs // 2)),
    ]
    if not h.shared_classifier:
        out.append(("wcls", (h.vocab_size, h.dim)))
    return out


def read_llama2c_checkpoint(path: str | os.PathLike) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """Header and float32 arrays (run.c names) of a legacy llama2.c checkpoint; the size must match exactly."""
    h = read_header(path)
    layout = _layout(h)
    n_floats = sum(int(torch.tensor(s).prod()) for _, s in layout)
    size = os.path.getsize(path)
    expected = HEADER.size + 4 * n_floats
    if size != expected:
        raise ValueError(
            f"{path}: {size} bytes but the header {h} implies {expected} "
            f"(legacy llama2.c format, float32, {'shared' if h.shared_classifier else 'separate'} classifier)"
        )
    with open(path, "rb") as f:
        f.seek(HEADER.size)
        flat = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    if not torch.isfinite(flat).all():
        raise ValueError(f"{path}: non-finite weights")
    out, off = {}, 0
    for name, shape in layout:
        n = int(torch.tensor(shape).prod())
        out[name] = flat[off: off + n].view(shape).clone()
        off += n
    if h.shared_classifier:
        out["wcls"] = out["token_embedding_table"]
    return h, out


def interleaved_to_half_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k projection rows from interleaved-pair RoPE (llama2.c / Meta) to rotate-half RoPE (HF).

    Within each head, output row order becomes (0, 2, 4, ..., hs-2, 1, 3, ..., hs-1).
    """
    out_dim, in_dim = w.shape
    hs = out_dim // n_heads
    return w.view(n_heads, hs // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def llama2c_config(h: Llama2cHeader, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5):
    """The transformers LlamaConfig for a llama2.c header (run.c: RMSNorm eps 1e-5, RoPE base 10000, SwiGLU)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=h.vocab_size,
        hidden_size=h.dim,
        intermediate_size=h.hidden_dim,
        num_hidden_layers=h.n_layers,
        num_attention_heads=h.n_heads,
        num_key_value_heads=h.n_kv_heads,
        head_dim=h.head_size,
        hidden_act="silu",
        max_position_embeddings=h.seq_len,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=h.shared_classifier,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
    )


def hf_state_dict(h: Llama2cHeader, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """run.c arrays -> LlamaForCausalLM state dict (q/k rows permuted for HF's rotary convention)."""
    sd = {"model.embed_tokens.weight": w["token_embedding_table"], "model.norm.weight": w["rms_final_weight"]}
    for i in range(h.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = w["rms_att_weight"][i]
        sd[p + "post_attention_layernorm.weight"] = w["rms_ffn_weight"][i]
        sd[p + "self_attn.q_proj.weight"] = interleaved_to_half_rotary(w["wq"][i], h.n_heads)
        sd[p + "self_attn.k_proj.weight"] = interleaved_to_half_rotary(w["wk"][i], h.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = w["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = w["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = w["w1"][i]
        sd[p + "mlp.down_proj.weight"] = w["w2"][i]
        sd[p + "mlp.up_proj.weight"] = w["w3"][i]
    sd["lm_head.weight"] = w["wcls"]
    return {k: v.contiguous() for k, v in sd.items()}


def load_llama2c(bin_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """A transformers `LlamaForCausalLM` with the weights of a llama2.c checkpoint (default: shipped stories260K)."""
    from transformers import LlamaForCausalLM

    h, w = read_llama2c_checkpoint(bin_path or default_checkpoint())
    model = LlamaForCausalLM(llama2c_config(h))
    sd = hf_state_dict(h, w)
    if h.shared_classifier:
        sd.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (h.shared_classifier and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"llama2.c conversion: missing {missing}, unexpected {unexpected}")
    if h.shared_classifier:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS_ID, EOS_ID, None
    return model.to(dtype).eval()


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def read_llama2c_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> tuple[list[bytes], list[float], int]:
    """(tokens as bytes, scores, max_token_length) of a llama2.c tokenizer file. `vocab_size` (from the checkpoint
    header) is checked when given; otherwise the whole file is read."""
    data = Path(path).read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for a llama2.c tokenizer")
    (max_len,) = struct.unpack_from("<i", data, 0)
    off, tokens, scores = 4, [], []
    while off < len(data) and (vocab_size is None or len(tokens) < vocab_size):
        if off + 8 > len(data):
            raise ValueError(f"{path}: truncated entry for token {len(tokens)} at byte {off}")
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if n < 0 or n > max_len or off + n > len(data):
            raise ValueError(f"{path}: token {len(tokens)} has length {n} (max_token_length {max_len}) at byte {off - 4}")
        tokens.append(data[off: off + n])
        scores.append(score)
        off += n
    if vocab_size is not None and len(tokens) != vocab_size:
        raise ValueError(f"{path}: {len(tokens)} tokens, the model has {vocab_size}")
    if off != len(data):
        raise ValueError(f"{path}: {len(data) - off} trailing bytes after {len(tokens)} tokens")
    return tokens, scores, max_len


def _piece(i: int, b: bytes) -> str:
    if i == UNK_ID:
        return "<unk>"
    if i == BOS_ID:
        return "<s>"
    if i == EOS_ID:
        return "</s>"
    try:
        s = b.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"token {i} ({b!r}) is not valid UTF-8") from None
    return s.replace(" ", "▁")


def llama2c_tokenizer(tok_path: str | os.PathLike | None = None, vocab_size: int | None = None):
    """A `tokenizers.Tokenizer` (sentencepiece-style BPE with byte fallback, `▁` for spaces, BOS added) equivalent
    to run.c's encoder for the given llama2.c tokenizer file (default: shipped tok512.bin)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tok_path = tok_path or default_tokenizer()
    tokens, scores, _ = read_llama2c_tokenizer(tok_path, vocab_size)
    pieces = [_piece(i, b) for i, b in enumerate(tokens)]
    vocab: dict[str, int] = {}
    for i, p in enumerate(pieces):
        if p in vocab:
            raise ValueError(f"{tok_path}: tokens {vocab[p]} and {i} are both {p!r}")
        vocab[p] = i
    for b in range(256):
        if pieces[b + 3] != f"<0x{b:02X}>":
            raise ValueError(f"{tok_path}: expected byte-fallback token <0x{b:02X}> at id {b + 3}, got {pieces[b + 3]!r}")
    special = {UNK_ID, BOS_ID, EOS_ID} | set(range(3, 259))
    # every way of writing a piece as two pieces is a merge, ranked by the merged piece's score (run.c's priority)
    merges = []
    for i, p in enumerate(pieces):
        if i in special or len(p) < 2:
            continue
        for k in range(1, len(p)):
            a, b = p[:k], p[k:]
            if vocab.get(a, 0) not in special and vocab.get(b, 0) not in special:
                merges.append((-scores[i], i, vocab[a], (a, b)))
    merges.sort()
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[m[3] for m in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    # run.c prepends the dummy-prefix space unconditionally (Metaspace would skip it before a leading space)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


def llama2c_hf_tokenizer(tok_path: str | os.PathLike | None = None, vocab_size: int | None = None):
    """`PreTrainedTokenizerFast` around `llama2c_tokenizer` (bos <s>=1, eos </s>=2, unk <unk>=0; BOS added)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=llama2c_tokenizer(tok_path, vocab_size),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def save_hf(
    out_dir: str | os.PathLike,
    bin_path: str | os.PathLike | None = None,
    tok_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a standard HF directory (config.json, model.safetensors, generation_config.json, tokenizer files)
    converted from a llama2.c checkpoint and tokenizer (defaults: the shipped stories260K + tok512)."""
    from .tiny import save_tokenizer_portable

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load_llama2c(bin_path, dtype)
    model.save_pretrained(str(out))
    save_tokenizer_portable(llama2c_hf_tokenizer(tok_path, model.config.vocab_size), out)
    src = {}
    for key, path in (("checkpoint", Path(bin_path or default_checkpoint())), ("tokenizer", Path(tok_path or default_tokenizer()))):
        src[key] = {"file": path.name, "bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    with open(out / "llama2c_source.json", "w", encoding="utf-8") as f:
        json.dump(src, f, indent=2)
        f.write("\n")
    return out
