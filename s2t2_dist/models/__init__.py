"""HF model loading and the translated-LM wrapper. (Source-model recipes: llama2.c converter, English pretraining,
tiny models from real configs, live in s2t2_dist.recipes.)

transformers is imported lazily (inside the functions), so importing this package is cheap.
"""

from .hf import (
    asset_path,
    freeze,
    get_embedding_and_head,
    load_causal_lm,
)
from .translated import TranslatedLM, TranslatedOutput, backbone_of, materialize, shifted_nll

__all__ = [
    "TranslatedLM",
    "TranslatedOutput",
    "asset_path",
    "backbone_of",
    "freeze",
    "get_embedding_and_head",
    "load_causal_lm",
    "materialize",
    "shifted_nll",
]
