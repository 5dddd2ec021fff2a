"""Loading Hugging Face causal LMs, their embedding / head matrices, and the source-token ids S2T2 translates from.

`source_token_ids` returns the ids of REAL tokens only: models pad their embedding tables (OLMo: 50,304 rows for a
50,280-token vocabulary) and the padding rows correspond to no token, so they must never be source tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import torch

from s2t2_dist.config import ConfigError
from s2t2_dist.errors import UnsupportedModel, ModelLoadError

ASSETS = Path(__file__).resolve().parent.parent / "assets"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _tensor_groups(keys: list[str], shown: int = 3) -> str:
    """`model.layers.2-31 (270 tensors), lm_head.weight`: numbered blocks folded into ranges."""
    import re

    groups: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for k in keys:
        m = re.match(r"^(.*?\.)(\d+)\.", k)
        head = m.group(1) if m else k
        groups.setdefault(head, set())
        counts[head] = counts.get(head, 0) + 1
        if m:
            groups[head].add(int(m.group(2)))
    parts = []
    for head, idx in groups.items():
        if idx:
            lo, hi = min(idx), max(idx)
            rng = f"{lo}-{hi}" if len(idx) == hi - lo + 1 and hi > lo else ",".join(map(str, sorted(idx)[:6]))
            parts.append(f"{head}{rng} ({counts[head]} tensors)")
        else:
            parts.append(head)
    more = f", ... ({len(parts) - shown} more)" if len(parts) > shown else ""
    return ", ".join(parts[:shown]) + more


def check_loading_info(path: str | os.PathLike, info: dict) -> None:
    """After `from_pretrained(..., output_loading_info=True)`: every tensor the model needs came from the weights
    and every tensor of the weights was used, else ModelLoadError (transformers only prints a load report and
    initialises the missing ones at random)."""
    missing, unexpected = list(info.get("missing_keys") or []), list(info.get("unexpected_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if not (missing or unexpected or mismatched):
        return
    said = []
    if missing:
        said.append(f"{len(missing)} tensors the model needs are not in the weights ({_tensor_groups(missing)})")
    if unexpected:
        said.append(f"{len(unexpected)} tensors of the weights are not used by the model "
                    f"({_tensor_groups(unexpected)})")
    if mismatched:
        names = [m[0] if isinstance(m, (tuple, list)) else str(m) for m in mismatched]
        said.append(f"{len(names)} tensors have other shapes than config.json gives ({_tensor_groups(names)})")
    raise ModelLoadError(f"model.path {path}: the weights do not match config.json: {'; '.join(said)}; the model "
                         "would run with random parts (is config.json the one saved with these weights?)")


def from_pretrained_checked(path: str | os.PathLike, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` that refuses a model that loads wrong
    (`check_loading_info`; a shape mismatch transformers raises on is said in one line too)."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise
        raise ModelLoadError(f"model.path {path}: tensor shapes in the weights differ from what config.json "
                             "describes (transformers' load report above lists them); is config.json the one "
                             "saved with these weights?") from None
    check_loading_info(path, info)
    return model


def asset_path(*parts: str) -> Path:
    """Path of a file shipped in `s2t2_dist/assets/` (raises FileNotFoundError naming it if missing)."""
    p = ASSETS.joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"shipped asset not found: {p} (is the package installed with its data files?)")
    return p


def torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """A dtype's name (`"float32"`/`"bf16"`/...) or a torch.dtype -> torch.dtype; `"auto"` and None are passed
    through. (The compute dtype of a run, from train.precision and the device, is stages.common.compute_dtype.)"""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[key]


def _dtype_kwarg() -> str:
    """transformers >= 4.56 takes `dtype=`, older versions `torch_dtype=`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """requires_grad=False on every parameter and eval mode (no dropout). Returns the model."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_causal_lm(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = "cpu",
    trust_remote_code: bool = False,
    frozen: bool = False,
    **kwargs: Any,
):
    """`AutoModelForCausalLM.from_pretrained(path_or_id)` in `dtype` on `device`.

    `frozen=True` freezes every parameter (the S2T2 translation stage trains only the translator). Extra keyword
    arguments go to `from_pretrained` (e.g. `device_map`, `revision`, `attn_implementation`); with `device_map`,
    `device` is ignored.
    """
    if dtype is not None:
        kwargs[_dtype_kwarg()] = torch_dtype(dtype)
    model = from_pretrained_checked(path_or_id, trust_remote_code=trust_remote_code, **kwargs)
    if device is not None and "device_map" not in kwargs:
        model = model.to(device)
    return freeze(model) if frozen else model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block's activations in backward (HF gradient checkpointing, non-reentrant: the
    gradient reaches inputs that need it through a frozen body). The one setup of both stages and every engine.
    HF checkpoints only in training mode: a caller whose model stays in eval mode must switch it to train()."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ConfigError(f"activation checkpointing needs a transformers model; {type(model).__name__} has no "
                          "gradient_checkpointing_enable")


def build_causal_lm(source, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    seed: int = 0, trust_remote_code: bool = False) -> torch.nn.Module:
    """A causal LM from a model directory / hub id (`load_causal_lm`), a transformers PretrainedConfig (random init,
    seeded) or an nn.Module (returned as it is); `dtype` None: float32; `device` None: where it was built."""
    if isinstance(source, torch.nn.Module):
        return source
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(source)
        return model.to(device) if device is not None else model
    return load_causal_lm(source, dtype=dtype or torch.float32, device=device, trust_remote_code=trust_remote_code)


def load_hf_tokenizer(path_or_id: str | os.PathLike, trust_remote_code: bool = False, **kwargs: Any):
    """transformers' AutoTokenizer of a model directory or hub id (a model's own tokenizer; the project's target
    tokenizers, with their special-token roles, are data.bpe.load_tokenizer's TokenizerInfo)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code, **kwargs)


def get_embedding_and_head(model) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(E, L, tied): the input embedding matrix [V, d], the output head matrix [V, d] and whether they share storage.

    V is the number of embedding ROWS (possibly padded beyond the tokenizer's vocabulary). Works for tied models
    (OLMo-1B, Llama with tie_word_embeddings) and untied ones (OLMo-7B).
    """
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    name = type(model).__name__
    if emb is None or head is None:
        raise UnsupportedModel(f"{name} has no input embeddings or no output head")
    if getattr(head, "bias", None) is not None:
        raise UnsupportedModel(f"{name}'s output head has a bias; S2T2 translates the head's weights only "
                               "(L' = W^T L) and has no translation for a per-token bias")
    E, L = getattr(emb, "weight", None), getattr(head, "weight", None)
    if not isinstance(E, torch.Tensor) or not isinstance(L, torch.Tensor) or E.dim() != 2:
        raise UnsupportedModel(f"{name}'s input embedding or output head is not one [V, d] weight matrix")
    if E.shape != L.shape:
        raise UnsupportedModel(f"{name}: embedding {tuple(E.shape)} and head {tuple(L.shape)} shapes differ")
    tied = E is L or (E.data_ptr() == L.data_ptr() and E.stride() == L.stride())
    return E, L, tied


# ----------------------------------------------------------------------------------------------------------------
# source tokens


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 / GPT-NeoX): printable character -> byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def tokenizers_backend(tokenizer_or_path):
    """-> (tokenizers.Tokenizer, description for error messages)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer_or_path, Tokenizer):
        return tokenizer_or_path, "tokenizer"
    if isinstance(tokenizer_or_path, (str, os.PathLike)):
        p = Path(tokenizer_or_path)
        if p.is_dir():
            if (p / "tokenizer.json").exists():
                return Tokenizer.from_file(str(p / "tokenizer.json")), str(p)
            return tokenizers_backend(load_hf_tokenizer(p))
        if p.is_file():
            return Tokenizer.from_file(str(p)), str(p)
        raise FileNotFoundError(f"no tokenizer at {p}")
    backend = getattr(tokenizer_or_path, "backend_tokenizer", None) or getattr(tokenizer_or_path, "_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"source_token_ids needs a fast (tokenizers-backed) tokenizer, a tokenizer.json or a directory; "
            f"got {type(tokenizer_or_path).__name__}"
        )
    return backend, type(tokenizer_or_path).__name__


def _has_type(node, name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence of components) contains one of type `name`."""
    if isinstance(node, dict):
        return node.get("type") == name or any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False


def token_bytes(tokenizer_or_path) -> dict[int, bytes | None]:
    """id -> the bytes of text the token stands for (None for special tokens), for every real id.

    Byte-level BPE tokens are mapped through the byte alphabet; sentencepiece-style tokens map `▁` to a space
    and `<0xNN>` byte-fallback tokens to that byte; added (non-special) tokens are their UTF-8 content.
    """
    tok, _ = tokenizers_backend(tokenizer_or_path)
    spec = json.loads(tok.to_str())
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(spec.get("decoder"), "ByteLevel")
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    bdec = byte_level_decoder()
    out: dict[int, bytes | None] = {}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        a = added.get(i)
        if a is not None and a.get("special"):
            out[i] = None
        elif a is not None and not byte_level:
            out[i] = a["content"].replace("▁", " ").encode("utf-8")
        elif a is not None:
            out[i] = a["content"].encode("utf-8")
        elif byte_level:
            try:
                out[i] = bytes(bdec[c] for c in token)
            except KeyError:  # a token outside the byte alphabet: take it literally
                out[i] = token.encode("utf-8")
        elif byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[i] = bytes([int(token[3:5], 16)])
        else:
            out[i] = token.replace("▁", " ").encode("utf-8")
    return out


def _one_char(b: bytes | None) -> bool:
    if not b:
        return False
    try:
        return len(b.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def read_id_file(path: str | os.PathLike, valid: Iterable[int] | None = None) -> list[int]:
    """Ids listed one per line (blank lines and `#` comments ignored). Errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"source-token id file not found: {p}")
    valid_set = set(valid) if valid is not None else None
    ids: list[int] = []
    seen: dict[int, int] = {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                i = int(text)
            except ValueError:
                raise ValueError(f"{p}:{lineno}: expected one integer token id, got {text!r}") from None
            if valid_set is not None and i not in valid_set:
                raise ValueError(f"{p}:{lineno}: id {i} is not a real token of the tokenizer (padding row or out of range)")
            if i in seen:
                raise ValueError(f"{p}:{lineno}: id {i} repeated (first on line {seen[i]})")
            seen[i] = lineno
            ids.append(i)
    if not ids:
        raise ValueError(f"{p}: no token ids listed")
    return ids


def source_token_ids(
    tokenizer_or_path,
    rule: str | os.PathLike = "all",
    *,
    num_embeddings: int | None = None,
    exclude_special: bool = False,
) -> torch.LongTensor:
    """Sorted ids of the source tokens S2T2 translates from (rows of E and L).

    rule:
      "all"          every real token id (OLMo: 50,280 ids; never the embedding's padding rows);
      "single_char"  tokens standing for exactly one character (the paper's "bytes" source tokens on text);
      "single_byte"  tokens standing for exactly one byte (byte-level BPE: the 256 byte tokens);
      a path, or "file:<path>": ids listed one per line (kept in the file's order, not sorted).
    `num_embeddings` (rows of E) is checked against the ids. Special tokens are excluded by the "single_*" rules
    always and by "all" when `exclude_special`.
    """
    tok, where = tokenizers_backend(tokenizer_or_path)
    real = sorted(tok.get_vocab(with_added_tokens=True).values())
    if len(set(real)) != len(real):
        raise ValueError(f"{where}: several tokens share an id")
    if num_embeddings is not None and real and real[-1] >= num_embeddings:
        raise ValueError(f"{where}: token id {real[-1]} >= the model's {num_embeddings} embedding rows")
    rule_s = os.fspath(rule)
    if rule_s in ("all", "single_char", "single_byte"):
        if rule_s == "all":
            if exclude_special:
                tb = token_bytes(tok)
                ids = [i for i in real if tb[i] is not None]
            else:
                ids = real
        else:
            tb = token_bytes(tok)
            keep = _one_char if rule_s == "single_char" else (lambda b: b is not None and len(b) == 1)
            ids = [i for i in real if keep(tb[i])]
            if not ids:
                raise ValueError(f"{where}: rule {rule_s!r} selects no tokens")
    else:
        path = rule_s[len("file:"):] if rule_s.startswith("file:") else rule_s
        if not rule_s.startswith("file:") and not Path(path).exists():
            raise ValueError(
                f"unknown source-token rule {rule_s!r}: use 'all', 'single_char', 'single_byte' or an id file path"
            )
        ids = read_id_file(path, valid=real)
        if exclude_special:
            tb = token_bytes(tok)
            ids = [i for i in ids if tb[i] is not None]
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class ModelPathConfig:
    """The `model:` section of every stage (translate extends it): a Hugging Face model directory or hub id
    (translate, finetune: the source model; evaluate: the model evaluated, or the source model a P file is applied
    to). Finetuning keeps float32 master weights (train.precision selects bf16 compute): no dtype key."""

    #: a Hugging Face model directory or hub id (translate, finetune: the source model; evaluate: the model
    #: evaluated, or the source model a P file is applied to)
    path: str = ""
    #: let transformers run the model repository's own Python code (models not built into transformers)
    trust_remote_code: bool = False

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path: the model (a Hugging Face directory or hub id) is required")
