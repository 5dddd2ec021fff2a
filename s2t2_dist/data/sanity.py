"""Warnings about prepared data that is almost certainly not what was meant, though it is well-formed.

Each check returns sentences for `prepare`'s summary (`warnings`) and log; none stops the run, because each can be
meant (a tiny corpus, a test). Malformed input is an error elsewhere (records.py, fasta.py), never a warning here.
Cost: the eval split (small) is read whole; at most `TRAIN_SCAN` train records are read for the overlap check.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger("s2t2.prepare")

#: the 20 standard amino acids
STANDARD_AA = set("ACDEFGHIKLMNPQRSTVWY")
#: fewer held-out documents than this give a BpB too noisy to compare runs by
MIN_EVAL_DOCS = 8
#: train records scanned for texts that also occur in the eval split
TRAIN_SCAN = 200_000


def _h(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=12).digest()


def split_warnings(split: dict, cfg) -> list[str]:
    """From the split step's counts: most records dropped, an empty or tiny eval split."""
    out = []
    read = split.get("records_read") or 0
    kept = split.get("records_kept") or 0
    dropped = read - kept
    if read and dropped / read > 0.5:
        why = {**split.get("skipped_bad", {}), **split.get("filtered", {})}
        out.append(f"{dropped:,} of {read:,} input records ({dropped / read:.0%}) were skipped or filtered "
                   f"({', '.join(f'{k}: {v:,}' for k, v in why.items())}): is this the right input and format?")
    n_eval = split.get("eval_records") or 0
    if cfg.eval_fraction > 0 and n_eval == 0:
        out.append(f"the eval split is empty (eval_fraction={cfg.eval_fraction} of {kept:,} records): no held-out "
                   "evaluation is possible; raise eval_fraction")
    elif 0 < n_eval < MIN_EVAL_DOCS:
        out.append(f"the eval split holds only {n_eval} records: its BpB will be too noisy to compare runs by; "
                   "raise eval_fraction")
    return out


def content_warnings(split_dir: Path, cfg) -> list[str]:
    """From the texts: protein data that is mostly not standard residues, FASTA read as plain text, eval texts
    that also occur in the train split."""
    from .split import iter_split_docs, load_split

    m = load_split(split_dir)
    out = []
    eval_hashes: set[bytes] = set()
    chars = nonstd = headers = docs = 0
    for _, _, text in iter_split_docs(split_dir, "eval"):
        eval_hashes.add(_h(text))
        docs += 1
        chars += len(text)
        if cfg.domain == "protein":
            nonstd += sum(1 for c in text if c.upper() not in STANDARD_AA)
        elif text.startswith(">"):
            headers += 1
    if cfg.domain == "protein" and chars and nonstd / chars > 0.1:
        out.append(f"{nonstd / chars:.0%} of the eval split's residues are not among the 20 standard amino acids "
                   "(X, B, Z, U, O or other letters): is this protein data?")
    if cfg.domain == "text" and docs and headers / docs > 0.2:
        out.append(f"{headers} of {docs} eval documents start with '>': FASTA read as plain text? "
                   "(format: fasta, domain: protein)")
    if eval_hashes:
        scanned = dup = 0
        for _, _, text in iter_split_docs(split_dir, "train"):
            if scanned >= TRAIN_SCAN:
                break
            scanned += 1
            dup += _h(text) in eval_hashes
        if dup:
            total = m["records"]["train"]
            of = f"{scanned:,} train records" + (f" (of {total:,})" if total > scanned else "")
            out.append(f"{dup:,} of {of} have the same text as an eval record: the held-out score is not held "
                       "out (duplicates under other ids); split_by: text keeps identical texts in one split")
    return out


def tokenizer_warnings(report: dict, cfg) -> list[str]:
    got = report.get("vocab_size")
    if got is not None and got < cfg.vocab_size:
        return [f"the tokenizer has {got} tokens, fewer than vocab_size={cfg.vocab_size}: the training sample has "
                f"too few distinct merges (min_frequency={cfg.min_frequency}); every token id is < {got}"]
    return []


def emit(warnings: list[str]) -> None:
    for w in warnings:
        log.warning("%s", w)
