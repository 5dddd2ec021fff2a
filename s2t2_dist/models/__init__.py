"""HF model loading, tiny models from real configs, the llama2.c converter and the translated-LM wrapper.

transformers is imported lazily (inside the functions), so importing this package is cheap.
"""

from .hf import (
    asset_path,
    freeze,
    get_embedding_and_head,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    source_token_ids,
    token_bytes,
)
from .llama2c import load_llama2c, llama2c_hf_tokenizer, llama2c_tokenizer, read_llama2c_checkpoint, save_hf
from .pretrain_english import EnglishLMConfig, PretrainResult, byte_hf_tokenizer, pretrain_english
from .tiny import olmo_tokenizer, real_config_dict, save_olmo_tokenizer, save_tiny, tiny_config, tiny_from_config
from .translated import TranslatedLM, TranslatedOutput, backbone_of, materialize, shifted_nll

__all__ = [
    "EnglishLMConfig",
    "PretrainResult",
    "TranslatedLM",
    "TranslatedOutput",
    "asset_path",
    "backbone_of",
    "byte_hf_tokenizer",
    "freeze",
    "get_embedding_and_head",
    "llama2c_hf_tokenizer",
    "llama2c_tokenizer",
    "load_causal_lm",
    "load_llama2c",
    "load_tokenizer",
    "materialize",
    "olmo_tokenizer",
    "pretrain_english",
    "read_llama2c_checkpoint",
    "real_config_dict",
    "resolve_dtype",
    "save_hf",
    "save_olmo_tokenizer",
    "save_tiny",
    "shifted_nll",
    "source_token_ids",
    "tiny_config",
    "tiny_from_config",
    "token_bytes",
]
