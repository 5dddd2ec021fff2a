"""Tiny random causal LMs of several architectures (transformers' own config classes, no downloads) that speak a
small protein BPE, and the prepared protein shards they are trained on."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

D, ROWS, CTX = 32, 72, 32


def _configs():
    import transformers as T

    common = dict(vocab_size=ROWS, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": lambda: T.LlamaConfig(**common),
        "olmo": lambda: T.OlmoConfig(**common),
        "olmo2": lambda: T.Olmo2Config(**common),
        "qwen2": lambda: T.Qwen2Config(**common),
        "mistral": lambda: T.MistralConfig(**common),
        # embeddings scaled by sqrt(d) inside its embedding module
        "gemma": lambda: T.GemmaConfig(**common, head_dim=8),
        "gpt_neox": lambda: T.GPTNeoXConfig(vocab_size=ROWS, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64),
        # Conv1D layers and learned positions
        "gpt2": lambda: T.GPT2Config(vocab_size=ROWS, n_embd=D, n_layer=2, n_head=4, n_positions=64),
    }


ARCHS = list(_configs())


def save_model(out: Path, arch: str, tied: bool, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    cfg = _configs()[arch]()
    cfg.tie_word_embeddings = tied
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():  # the model "speaks" the small BPE (its source tokenizer)
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out


def prepare_arch_data(root: Path, n_records: int = 60) -> Path:
    """Protein shards (context CTX) and a 64-token BPE, in root/data."""
    from tests.helpers.finetune_fixtures import FASTA, sample_fasta

    from s2t2_dist.data import DataConfig, prepare

    fasta = sample_fasta(FASTA, root / "sample.fasta", n_records, max_len=300)
    cfg = DataConfig(inputs=[str(fasta)], output_dir=str(root / "data"), eval_fraction=0.1, vocab_size=64,
                     context_len=CTX, shard_size=64, num_workers=0, tokenizer_max_records=None)
    prepare(cfg, progress=False)
    return root / "data"
