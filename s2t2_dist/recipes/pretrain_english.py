"""Recipe: pretrain a small byte-level English LM (OLMo architecture) as an S2T2 source model.

The paper's source tokens are bytes; this recipe gives a source model whose vocabulary IS the 256 bytes (+ two
specials), trained on English text (plain .txt files, or .jsonl / .jsonl.gz / .json.gz with a `text` field).
The result is a standard HF directory (OlmoForCausalLM + a byte-level tokenizer AutoTokenizer loads), cached under
`<cache_root>/english-bytes-<hash>/`: the hash covers the recipe config and the CONTENT of the data files, so a
second call with the same config reuses it instead of retraining.

    python -m s2t2_dist.recipes.pretrain_english --data input.txt --cache-root runs/source_lm --steps 2000

A plain torch AdamW loop (warm-up + cosine); the project's distributed training loop is elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterable

import torch

RECIPE_FILE = "s2t2_recipe.json"
RECIPE_VERSION = 1
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
EOS_ID, PAD_ID = 256, 257
N_REAL_TOKENS = 258


@dataclass
class EnglishLMConfig:
    data: list[str] = field(default_factory=list)  # .txt / .jsonl / .jsonl.gz / .json.gz files
    text_key: str = "text"  # field of the JSON records
    max_bytes: int | None = None  # use at most this many bytes of the stream (None: all)
    val_fraction: float = 0.05  # tail of the byte stream held out for validation
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    intermediate: int | None = None  # default 4 * d_model
    vocab_rows: int = 264  # embedding rows: 258 tokens padded to a multiple of 8 (rows >= 258 are no token)
    tie_word_embeddings: bool = True  # as OLMo-1B
    context_len: int = 256
    batch_size: int = 16
    steps: int = 500
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_batches: int = 4
    seed: int = 0

    def validate(self) -> None:
        if not self.data:
            raise ValueError("EnglishLMConfig.data: give at least one text file")
        if self.vocab_rows < N_REAL_TOKENS:
            raise ValueError(f"vocab_rows {self.vocab_rows} < {N_REAL_TOKENS} tokens")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} not a multiple of n_heads {self.n_heads}")
        if not 0 < self.val_fraction < 1:
            raise ValueError("val_fraction must be in (0, 1)")
        for k in ("n_layers", "d_model", "n_heads", "context_len", "batch_size", "steps", "eval_batches"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive")


@dataclass
class PretrainResult:
    path: Path
    reused: bool
    info: dict


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def byte_tokenizer():
    """`tokenizers.Tokenizer`: id b (0..255) is byte b (byte-level alphabet, no merges); 256 = <|endoftext|>
    (eos and bos), 257 = <|padding|>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from s2t2_dist.api import byte_level_decoder

    vocab = {ch: b for ch, b in byte_level_decoder().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False),
                            AddedToken(PAD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID and tok.token_to_id(PAD_TOKEN) == PAD_ID
    return tok


def byte_hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer(), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


# ----------------------------------------------------------------------------------------------------------------
# data


def iter_documents(path: str | os.PathLike, text_key: str = "text") -> Iterable[str]:
    """Documents of a file: a .txt file is one document; JSON-lines files (optionally gzipped) give one per record."""
    p = Path(path)
    name = p.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".json")):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{lineno}: not a JSON record ({e})") from None
                if not isinstance(rec, dict) or text_key not in rec:
                    raise ValueError(f"{p}:{lineno}: record has no {text_key!r} field")
                yield str(rec[text_key])
    else:
        yield p.read_text(encoding="utf-8")


def byte_stream(cfg: EnglishLMConfig) -> torch.Tensor:
    """All documents' UTF-8 bytes, each followed by <|endoftext|>, as one int64 tensor (at most max_bytes)."""
    chunks, total = [], 0
    for path in cfg.data:
        for doc in iter_documents(path, cfg.text_key):
            b = torch.frombuffer(bytearray(doc.encode("utf-8")), dtype=torch.uint8).long()
            chunks += [b, torch.tensor([EOS_ID])]
            total += b.numel() + 1
            if cfg.max_bytes is not None and total >= cfg.max_bytes:
                return torch.cat(chunks)[: cfg.max_bytes]
    return torch.cat(chunks)


def data_fingerprint(paths: Iterable[str]) -> list[dict]:
    out = []
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        out.append({"name": Path(p).name, "bytes": os.path.getsize(p), "sha256": h.hexdigest()})
    return out


def config_hash(cfg: EnglishLMConfig) -> str:
    """Hash of the recipe (config without file paths + data content + recipe version)."""
    d = asdict(cfg)
    d.pop("data")
    d["data_content"] = data_fingerprint(cfg.data)
    d["recipe_version"] = RECIPE_VERSION
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# model and training


def olmo_byte_config(cfg: EnglishLMConfig):
    from transformers import OlmoConfig

    return OlmoConfig(
        vocab_size=cfg.vocab_rows,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.intermediate or 4 * cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=cfg.context_len,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def _lr_at(step: int, cfg: EnglishLMConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _batch(stream: torch.Tensor, cfg: EnglishLMConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - cfg.context_len, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s: s + cfg.context_len] for s in starts.tolist()])


@torch.no_grad()
def _eval_loss(model, stream: torch.Tensor, cfg: EnglishLMConfig) -> float:
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # same validation batches every time
    model.eval()
    losses = [float(model(input_ids=(x := _batch(stream, cfg, gen)), labels=x).loss) for _ in range(cfg.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def train_english_lm(cfg: EnglishLMConfig, log=print):
    """Train from scratch; returns (model, info dict with losses)."""
    from transformers import OlmoForCausalLM

    cfg.validate()
    stream = byte_stream(cfg)
    n_val = max(cfg.context_len + 1, int(stream.numel() * cfg.val_fraction))
    if stream.numel() - n_val <= cfg.context_len + 1:
        raise ValueError(f"{stream.numel()} bytes of text: too little for context_len {cfg.context_len} + validation")
    train, val = stream[:-n_val], stream[-n_val:]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = OlmoForCausalLM(olmo_byte_config(cfg))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    val_before = _eval_loss(model, val, cfg)
    losses, t0 = [], time.time()
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        x = _batch(train, cfg, gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        if log and (step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1):
            log(f"[pretrain_english] step {step + 1}/{cfg.steps} loss {losses[-1]:.4f} ({time.time() - t0:.1f}s)")
    val_after = _eval_loss(model, val, cfg)
    info = {
        "train_bytes": int(train.numel()),
        "val_bytes": int(val.numel()),
        "train_losses": losses,
        "val_loss_before": val_before,
        "val_loss_after": val_after,
        "val_bpb_after": val_after / math.log(2),  # one token per byte (EOS tokens counted as bytes here)
        "seconds": time.time() - t0,
    }
    return model.eval(), info


def pretrain_english(
    cfg: EnglishLMConfig,
    cache_root: str | os.PathLike = "runs/source_lm",
    force: bool = False,
    log=print,
) -> PretrainResult:
    """Train (or reuse) the byte-level English LM for `cfg`; returns its HF directory."""
    from .tiny import save_tokenizer_portable

    cfg.validate()
    digest = config_hash(cfg)
    root = Path(cache_root)
    out = root / f"english-bytes-{digest[:12]}"
    recipe = out / RECIPE_FILE
    if out.exists() and not force:
        try:
            with open(recipe, encoding="utf-8") as f:
                saved = json.load(f)
            if saved.get("config_hash") == digest and (out / "config.json").exists():
                if log:
                    log(f"[pretrain_english] reusing {out}")
                return PretrainResult(out, True, saved)
        except (OSError, json.JSONDecodeError):
            pass
        if log:
            log(f"[pretrain_english] {out} is incomplete or stale: retraining")
    model, info = train_english_lm(cfg, log=log)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    save_tokenizer_portable(byte_hf_tokenizer(), tmp)
    saved = {"config_hash": digest, "config": asdict(cfg), "data_content": data_fingerprint(cfg.data), **info}
    with open(tmp / RECIPE_FILE, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=1)
        f.write("\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if log:
        log(f"[pretrain_english] saved {out} (val loss {info['val_loss_before']:.3f} -> {info['val_loss_after']:.3f})")
    return PretrainResult(out, False, saved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m s2t2_dist.recipes.pretrain_english", description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help=".txt / .jsonl[.gz] / .json.gz files")
    ap.add_argument("--cache-root", default="runs/source_lm")
    ap.add_argument("--force", action="store_true", help="retrain even if a cached model exists")
    for f in dataclasses.fields(EnglishLMConfig):
        if f.name == "data":
            continue
        kind = {"int": int, "float": float, "str": str, "bool": lambda s: s.lower() in ("1", "true", "yes")}
        typ = str(f.type).replace("Optional[", "").rstrip("]")
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind.get(typ, str), default=None)
    args = ap.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(EnglishLMConfig)
                 if f.name != "data" and getattr(args, f.name) is not None}
    cfg = EnglishLMConfig(data=list(args.data), **overrides)
    res = pretrain_english(cfg, args.cache_root, force=args.force)
    print(res.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
