"""Tiny random models with the architecture of REAL configs (OLMo-1B / OLMo-7B as published on the HF hub).

No weights can be downloaded in tests, so tests and demos build a model of the real type (`OlmoForCausalLM`), the
real tying (1B tied, 7B untied), the real vocabulary (50,304 embedding rows, of which 50,280 are tokens) and the real
tokenizer, with only the depth and widths shrunk, and save it with `save_pretrained` so that the real
`from_pretrained` code path loads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from s2t2_dist.api import asset_path

# Aliases of the shipped configs (s2t2_dist/assets/olmo/, transcribed from the hub's config.json files).
_SHIPPED = {
    "olmo-1b": "OLMo-1B-hf.config.transcribed.json",
    "olmo-7b": "OLMo-7B-hf.config.transcribed.json",
}
_ALIASES = {
    "olmo-1b": "olmo-1b", "olmo-1b-hf": "olmo-1b", "allenai/olmo-1b-hf": "olmo-1b", "allenai/olmo-1b": "olmo-1b",
    "olmo-7b": "olmo-7b", "olmo-7b-hf": "olmo-7b", "allenai/olmo-7b-hf": "olmo-7b", "allenai/olmo-7b": "olmo-7b",
}

OLMO_TOKENIZER_FILE = "allenai_gpt-neox-olmo-dolma-v1_5.json"
OLMO_EOS_ID = 50279
OLMO_PAD_ID = 1


def real_config_dict(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """The real config as a dict: a shipped name ("olmo-1b", "allenai/OLMo-7B-hf", ...), a config.json file, or a
    directory holding one. Keys starting with `_` (notes) are dropped."""
    key = str(name_or_path).lower()
    if key in _ALIASES:
        path = asset_path("olmo", _SHIPPED[_ALIASES[key]])
    else:
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no config {name_or_path!r}: give one of {sorted(set(_ALIASES))}, a config.json or a model directory"
            )
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if "model_type" not in cfg:
        raise ValueError(f"{path}: no 'model_type' key, cannot tell the architecture")
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def tiny_config(
    name_or_path: str | os.PathLike,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    intermediate: int | None = None,
    vocab: int | None = None,
    n_kv_heads: int | None = None,
    max_position_embeddings: int | None = None,
):
    """The real config with depth and widths shrunk (everything else, incl. model type and tying, kept).

    intermediate: default keeps the real MLP/width ratio (OLMo-1B 4.0, OLMo-7B 2.6875), rounded to a multiple of 8.
    vocab: default keeps the real embedding rows (OLMo: 50,304); a smaller value must still cover the tokens used.
    n_kv_heads: default keeps the real heads / kv-heads ratio.
    """
    from transformers import AutoConfig

    d = real_config_dict(name_or_path)
    if d_model % n_heads:
        raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
    real_h, real_d = d.get("num_attention_heads"), d.get("hidden_size")
    if intermediate is None:
        ratio = d.get("intermediate_size", 4 * real_d) / real_d
        intermediate = max(8, int(round(ratio * d_model / 8)) * 8)
    if n_kv_heads is None:
        real_kv = d.get("num_key_value_heads") or real_h
        n_kv_heads = max(1, n_heads * real_kv // real_h)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    d.update(
        num_hidden_layers=n_layers,
        hidden_size=d_model,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        intermediate_size=intermediate,
    )
    if "head_dim" in d:
        d["head_dim"] = d_model // n_heads
    if vocab is not None:
        d["vocab_size"] = vocab
    if max_position_embeddings is not None:
        d["max_position_embeddings"] = max_position_embeddings
    for k in ("eos_token_id", "pad_token_id", "bos_token_id"):  # special ids beyond a shrunk vocabulary
        if isinstance(d.get(k), int) and d[k] >= d["vocab_size"]:
            d[k] = None
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


def tiny_from_config(
    name_or_path: str | os.PathLike,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    intermediate: int | None = None,
    vocab: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
):
    """A randomly initialised model (real architecture class, e.g. `OlmoForCausalLM`) from a shrunk real config.

    Deterministic in `seed`; the global RNG state is left untouched.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(name_or_path, n_layers, d_model, n_heads, intermediate, vocab, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(dtype)
    gc = getattr(model, "generation_config", None)
    if gc is not None:  # the hub's OLMo generation_config says eos 0 (= |||IP_ADDRESS|||); use the config's ids
        gc.eos_token_id = cfg.eos_token_id
        gc.pad_token_id = cfg.pad_token_id
        gc.bos_token_id = getattr(cfg, "bos_token_id", None)
    return model.eval()


def olmo_tokenizer():
    """The real OLMo-1B-hf / OLMo-7B-hf tokenizer (shipped JSON) as a fast HF tokenizer: eos 50279, pad 1, no bos."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(asset_path("olmo", OLMO_TOKENIZER_FILE)),
        eos_token="<|endoftext|>",
        pad_token="<|padding|>",
    )
    assert tok.eos_token_id == OLMO_EOS_ID and tok.pad_token_id == OLMO_PAD_ID, "unexpected OLMo tokenizer file"
    return tok


def save_tokenizer_portable(tokenizer, out_dir: str | os.PathLike) -> Path:
    """`tokenizer.save_pretrained(out_dir)`, with `tokenizer_class` set to "PreTrainedTokenizerFast" (a name both
    transformers 4.x and 5.x resolve; 5.x would otherwise write "TokenizersBackend", unknown to 4.x)."""
    out = Path(out_dir)
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return out


def save_olmo_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Write the OLMo tokenizer as a directory `AutoTokenizer.from_pretrained` loads."""
    return save_tokenizer_portable(olmo_tokenizer(), out_dir)


def save_tiny(
    out_dir: str | os.PathLike,
    name_or_path: str | os.PathLike = "olmo-1b",
    tokenizer: bool = True,
    **kwargs: Any,
) -> Path:
    """Build `tiny_from_config(name_or_path, **kwargs)` and save it (and, for OLMo, the real tokenizer) to out_dir."""
    model = tiny_from_config(name_or_path, **kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    if tokenizer:
        if model.config.model_type != "olmo":
            raise ValueError(f"no shipped tokenizer for model type {model.config.model_type!r}; pass tokenizer=False")
        if model.config.vocab_size < 50280:
            raise ValueError(f"vocab {model.config.vocab_size} < the OLMo tokenizer's 50,280 tokens; pass tokenizer=False")
        save_olmo_tokenizer(out)
    return out
