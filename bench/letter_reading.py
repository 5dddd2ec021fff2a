"""How well does a frozen source LM read proteins by itself? (a diagnostic, no P, no training)

A P-only model can only reuse what the frozen LM predicts. This scores the LM on a split's sequences in three ways,
in bits per byte (one byte per residue), beside two training-free lines:

* **own tokenizer**: the LM's own tokenization (multi-letter tokens), softmax over its whole vocabulary;
* **letters**: one residue letter per token (the LM's own single-letter token ids), softmax over its whole
  vocabulary, and renormalised over the residue letters only (the best a P that maps every letter to itself could
  hand it, before any training);
* **residue unigram**: the train split's letter frequencies, add-one smoothed (as `s2t2 reproduce` computes it);
* **adaptive unigram**: ``p(a | prefix) = (count of a in the sequence so far + k p_unigram(a)) / (n + k)``, for a
  few k: what a reader of nothing but the sequence's own composition gains over the unigram.

Each sequence is scored in windows of ``--window`` tokens after the LM's BOS (``<|im_start|>`` for SmolLM2), the
first token of each window predicted from the BOS alone.

    PYTHONPATH=. python -m bench.letter_reading --model ~/.cache/s2t2/source_lm/smollm2-135m-instruct-q4_1 \\
        --splits OUT/data/prepared/splits --split eval --json letters.json

Results: benchmarks/table1_smollm2_letters_cpu2_2026-11-29.md.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

from s2t2_dist.api import iter_split_texts
from s2t2_dist.api import residue_frequencies

ADAPTIVE_K = (5, 10, 20, 50, 100, 200)


def unigram_bits(p: dict[str, float], texts: list[str]) -> float:
    return -sum(math.log2(p[a]) for t in texts for a in t)


def adaptive_bits(p: dict[str, float], texts: list[str], k: float) -> float:
    """Bits of the in-sequence adaptive unigram: the prior ``p`` (weight k) plus the sequence's counts so far."""
    bits = 0.0
    for t in texts:
        seen: Counter = Counter()
        for n, a in enumerate(t):
            bits -= math.log2((seen[a] + k * p[a]) / (n + k))
            seen[a] += 1
    return bits


def window_bits(logits, targets, allowed=None) -> float:
    """Bits of ``targets`` (n,) under ``logits`` (n x V): softmax over the whole vocabulary, or over the ids in
    ``allowed`` (a LongTensor) with ``targets`` then given as positions in it."""
    import torch

    if allowed is not None:
        logits = logits[:, allowed]
    lp = torch.log_softmax(logits.float(), -1)
    return -float(lp.gather(1, targets[:, None]).sum()) / math.log(2)


def letter_ids(tok, alphabet: list[str]) -> list[int]:
    """The LM's own token id of each letter; an error naming the letter if it has none of its own."""
    ids = []
    for a in alphabet:
        t = tok.convert_tokens_to_ids(a)
        if t is None or t == tok.unk_token_id or tok.decode([t]) != a:
            raise ValueError(f"the tokenizer has no token of its own for the letter {a!r}")
        ids.append(t)
    return ids


def score(model_dir: str, train: list[str], texts: list[str], window: int, bos: str, progress=None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bos_id = tok.convert_tokens_to_ids(bos)
    if bos_id is None or bos_id == tok.unk_token_id:
        raise ValueError(f"--bos {bos!r} is not a token of {model_dir}")
    alphabet = sorted(set("".join(train)) | set("".join(texts)))
    ids = letter_ids(tok, alphabet)
    allowed = torch.tensor(ids)
    pos = {a: i for i, a in enumerate(alphabet)}
    n_bytes = sum(len(t.encode()) for t in texts)
    bits = {"letters_full_vocab": 0.0, "letters_residues_only": 0.0, "own_tokenizer": 0.0}
    own_tokens = 0
    with torch.no_grad():
        for n, t in enumerate(texts):
            for s in range(0, len(t), window):
                chunk = t[s:s + window]
                x = torch.tensor([[bos_id] + [ids[pos[a]] for a in chunk]])
                logits = model(x).logits[0, :-1]
                bits["letters_full_vocab"] += window_bits(logits, x[0, 1:])
                bits["letters_residues_only"] += window_bits(logits, torch.tensor([pos[a] for a in chunk]), allowed)
            own = tok(t, add_special_tokens=False)["input_ids"]
            for s in range(0, len(own), window):
                x = torch.tensor([[bos_id] + own[s:s + window]])
                bits["own_tokenizer"] += window_bits(model(x).logits[0, :-1], x[0, 1:])
                own_tokens += x.shape[1] - 1
            if progress:
                progress(n + 1, len(texts))
    p = residue_frequencies(train, alphabet)  # the table's residue unigram
    return {"sequences": len(texts), "bytes": n_bytes, "alphabet": "".join(alphabet), "window": window,
            "bpb": {k: v / n_bytes for k, v in bits.items()},
            "own_tokenizer_bytes_per_token": n_bytes / own_tokens,
            "residue_unigram_bpb": unigram_bits(p, texts) / n_bytes,
            "adaptive_unigram_bpb": {str(k): adaptive_bits(p, texts, k) / n_bytes for k in ADAPTIVE_K}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the source model's directory (HF format)")
    ap.add_argument("--splits", required=True, help="a prepared data directory's splits/ (train/ and the scored split)")
    ap.add_argument("--split", default="eval", help="the scored split's folder under --splits (default: eval)")
    ap.add_argument("--window", type=int, default=1023, help="tokens scored per window after the BOS")
    ap.add_argument("--bos", default="<|im_start|>", help="the token each window starts from")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default="", help="also write the report to this file")
    a = ap.parse_args(argv)
    if a.window < 1:
        print(f"letter_reading: --window must be >= 1, got {a.window}", file=sys.stderr)
        return 2
    if not (Path(a.model) / "config.json").is_file():
        print(f"letter_reading: --model {a.model}: no config.json (not a model directory)", file=sys.stderr)
        return 2
    try:
        train = list(iter_split_texts(a.splits, "train"))
        texts = list(iter_split_texts(a.splits, a.split))
    except (OSError, KeyError, ValueError) as e:  # DataError (no or a broken split manifest) is a ValueError
        print(f"letter_reading: --splits: {e}", file=sys.stderr)
        return 2
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    try:
        out = score(a.model, train, texts, a.window, a.bos,
                    progress=lambda i, n: print(f"{i}/{n}", file=sys.stderr) if i % 20 == 0 or i == n else None)
    except ValueError as e:
        print(f"letter_reading: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        tmp = Path(a.json + ".tmp")
        tmp.write_text(text)
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
