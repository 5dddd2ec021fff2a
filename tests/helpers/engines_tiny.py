"""Tiny OLMo-shaped models for the engine tests, in one place so they can be swapped for s2t2_dist.recipes.tiny
(built from the real OLMo configs) when it lands. Shapes follow OLMo: no biases, non-parametric layer norm, SwiGLU;
tie_word_embeddings True like OLMo-1B, False like OLMo-7B."""

from __future__ import annotations


def tiny_olmo_config(tie: bool = True, *, vocab: int = 512, layers: int = 2, d: int = 64, heads: int = 4,
                     mlp: int = 172, max_len: int = 128):
    from transformers import OlmoConfig

    return OlmoConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        max_position_embeddings=max_len, tie_word_embeddings=tie, pad_token_id=1, eos_token_id=0, bos_token_id=None,
        attention_dropout=0.0,
    )


def tiny_olmo(tie: bool = True, seed: int = 0, **kw):
    import torch
    from transformers import OlmoForCausalLM

    torch.manual_seed(seed)
    return OlmoForCausalLM(tiny_olmo_config(tie, **kw))
