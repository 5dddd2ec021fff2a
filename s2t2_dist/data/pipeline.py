"""`prepare`: the three data steps from one `DataConfig`, in a fixed layout under ``output_dir``::

    splits/                      step 1 (split_dataset)
    tokenizer/                   step 2 (train_tokenizer): the new BPE, AutoTokenizer-loadable
    shards/new/{train,eval}/     step 3 (write_shards) with the new tokenizer
    shards/source/{train,eval}/  step 3 with the source LM's tokenizer (if source_tokenizer is set)
    prepare_summary.json         counts of every step (written last)

Every step resumes or skips work already done, so re-running the same command after a crash continues.
"""

from __future__ import annotations

import time
from pathlib import Path

from s2t2_dist.utils.io import atomic_write_json

from .bpe import train_tokenizer
from .config import DataConfig
from .records import RecordPolicy
from .shards import write_shards
from .split import split_dataset


def policy_from_config(cfg: DataConfig) -> RecordPolicy:
    alpha = cfg.allowed_alphabet()
    return RecordPolicy(alphabet=alpha, extra_residues=cfg.extra_residues if alpha is not None else "",
                        extra_residue_policy=cfg.extra_residue_policy, replacement=cfg.replacement,
                        uppercase=cfg.uppercase, min_length=cfg.min_length, max_length=cfg.max_length,
                        on_bad_record=cfg.on_bad_record)


def tokenizer_alphabet(cfg: DataConfig) -> str | None:
    """Letters the new tokenizer must always contain (char-level BPE)."""
    alpha = cfg.allowed_alphabet()
    if alpha is None:
        return None
    extra = "" if cfg.extra_residue_policy in ("skip", "error") else (
        cfg.replacement if cfg.extra_residue_policy == "replace" else cfg.extra_residues)
    return "".join(sorted(set(alpha) | set(extra)))


def prepare(cfg: DataConfig, *, progress: bool = True, steps: tuple[str, ...] = ("split", "tokenizer", "shards")) -> dict:
    """Run the steps named in ``steps`` (in order); returns and saves a summary of every count."""
    cfg.validate()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary: dict = {"output_dir": str(out)}
    split_dir = out / "splits"
    tok_dir = out / "tokenizer"
    if "split" in steps:
        m = split_dataset(inputs=list(cfg.inputs), output_dir=split_dir, format=cfg.format, id_column=cfg.id_column,
                          text_column=cfg.text_column, hf_split=cfg.hf_split, text_mode=cfg.text_mode,
                          policy=policy_from_config(cfg), eval_fraction=cfg.eval_fraction, split_by=cfg.split_by,
                          seed=cfg.seed, chunk_records=cfg.chunk_records, progress=progress)
        summary["split"] = m["summary"]
    if "tokenizer" in steps:
        compare = {"source": cfg.source_tokenizer} if cfg.source_tokenizer else None
        rep = train_tokenizer(split_dir=split_dir, output_dir=tok_dir, vocab_size=cfg.vocab_size,
                              kind=cfg.resolved_tokenizer_kind(), alphabet=tokenizer_alphabet(cfg),
                              min_frequency=cfg.min_frequency, max_records=cfg.tokenizer_max_records, seed=cfg.seed,
                              context_len=cfg.context_len, compare_with=compare, progress=progress)
        summary["tokenizer"] = {"dir": str(tok_dir), "hash": rep.get("tokenizer_hash"),
                                "trained_on": rep.get("trained_on"), "compression": rep.get("compression")}
    if "shards" in steps:
        toks = {"new": tok_dir}
        if cfg.source_tokenizer:
            toks["source"] = cfg.source_tokenizer
        summary["shards"] = {}
        for name, tok in toks.items():
            for split in ("train", "eval"):
                m = write_shards(split_dir=split_dir, split=split, tokenizer=tok,
                                 output_dir=out / "shards" / name / split, context_len=cfg.context_len,
                                 shard_size=cfg.shard_size, num_workers=cfg.num_workers, progress=progress)
                summary["shards"][f"{name}/{split}"] = {"shards": len(m["shards"]), **m["totals"]}
    summary["seconds"] = round(time.time() - t0, 3)
    atomic_write_json(out / "prepare_summary.json", summary)
    if progress:
        print(format_summary(summary))
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"prepare: {summary.get('output_dir')} ({summary.get('seconds')} s)"]
    sp = summary.get("split")
    if sp:
        lines.append(f"  records read {sp['records_read']:,}, kept {sp['records_kept']:,} "
                     f"(train {sp['train_records']:,}, eval {sp['eval_records']:,})")
        for k, v in sp["skipped_bad"].items():
            lines.append(f"  skipped (malformed: {k}): {v:,}")
        for k, v in sp["filtered"].items():
            lines.append(f"  filtered ({k}): {v:,}")
        if sp.get("replaced_residues"):
            lines.append(f"  residues replaced: {sp['replaced_residues']:,}")
    tk = summary.get("tokenizer")
    if tk and tk.get("compression"):
        for name, c in tk["compression"]["tokenizers"].items():
            lines.append(f"  tokenizer {name}: {c['bytes_per_token']:.3f} bytes/token (vocab {c['vocab_size']:,})")
    for key, s in (summary.get("shards") or {}).items():
        lines.append(f"  shards {key}: {s['shards']} shards, {s['n_samples']:,} samples, {s['n_tokens']:,} tokens"
                     + (f", tail dropped {s['dropped_tail_tokens']}" if "dropped_tail_tokens" in s else ""))
    return "\n".join(lines)
