"""Eval documents from raw files (FASTA, FASTA.gz, jsonl, parquet, text) tokenized with a model's own tokenizer,
cached on disk: what `s2t2 evaluate data.files=[...]` scores.

No second reader or tokenizer path: the files go through the data pipeline's own steps, step 1 (`split_dataset`,
every record to the eval split, the record policy counting each one left out and why) and step 3 (`write_shards`,
documents `[start] doc` with their UTF-8 byte counts). The result is an ordinary eval-shard directory that
`loader.EvalDocs` reads and `eval.scoring` scores.

Cache: ``CACHE/<key>/{splits,eval}``, key = sha256 of the files' contents (sha256 each), their paths and formats, the
reader settings and the tokenizer's hash; a changed file or tokenizer gives a new key, an unchanged one is
tokenized once. Both steps resume after a crash and return at once when finished.
"""

from __future__ import annotations

import os
from pathlib import Path

from s2t2_dist import envvars
from s2t2_dist.utils.io import json_sha256, sha256_file

from .tokenizers import TokenizerInfo, load_tokenizer
from .records import RecordPolicy, resolve_inputs
from .shards import write_shards
from .split import split_dataset

#: every record goes to the eval split: split_of compares a 64-bit hash with eval_fraction * 2**64
ALL_TO_EVAL = 1.0


def default_cache_dir() -> Path:
    return Path(envvars.get("S2T2_CACHE_DIR") or Path.home() / ".cache" / "s2t2") / "tokenized"


def cache_key(files: list[tuple[str, str]], tokenizer_hash: str, reader: dict) -> str:
    """sha256 over the files' content hashes (and resolved paths and formats), the reader settings and the tokenizer
    hash (paths are part of it because the split manifest records them)."""
    return json_sha256({"files": [[os.path.abspath(p), fmt, sha256_file(p)] for p, fmt in files],
                        "tokenizer": tokenizer_hash, "reader": reader})[:24]


def tokenize_files(files: list[str], tokenizer: str | TokenizerInfo, *, cache_dir: str | os.PathLike | None = None,
                   format: str = "auto", text_column: str = "text", id_column: str | None = None,
                   text_mode: str = "line", on_bad_record: str = "skip", num_workers: int = 0,
                   progress: bool = True) -> dict:
    """Tokenize ``files`` with ``tokenizer`` (a tokenizer.json or a directory holding one, or a loaded one) into
    cached eval shards.

    Returns ``{"eval_dir", "cache_key", "files": [[path, format]], "records": {read, scored, left_out: {reason: n},
    examples: [...], unk_tokens (if the tokenizer has an unknown token)}}``. Every record read is either scored or
    counted under a reason (a malformed record, or an empty one: ``bad:<reason>``); ``on_bad_record="error"`` stops
    at the first, naming FILE:LINE.
    """
    resolved = resolve_inputs(files, format)
    info = tokenizer if isinstance(tokenizer, TokenizerInfo) else load_tokenizer(tokenizer)
    policy = RecordPolicy(alphabet=None, min_length=1, on_bad_record=on_bad_record)
    reader = {"format": format, "text_column": text_column, "id_column": id_column, "text_mode": text_mode,
              "policy": policy.to_dict(), "start_id": info.start_id, "eos_id": info.eos_id}
    key = cache_key(resolved, info.hash, reader)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / key
    split_m = split_dataset(inputs=list(files), output_dir=out / "splits", format=format, id_column=id_column,
                            text_column=text_column, text_mode=text_mode, policy=policy,
                            eval_fraction=ALL_TO_EVAL, split_by="id", seed=0, progress=progress)
    shard_m = write_shards(split_dir=out / "splits", split="eval", tokenizer=info, output_dir=out / "eval",
                           num_workers=num_workers, progress=progress)
    s = split_m["summary"]
    left = {**{f"bad:{k}": v for k, v in s["skipped_bad"].items()},
            **{f"filtered:{k}": v for k, v in s["filtered"].items()}}
    records = {"read": s["records_read"], "scored": shard_m["totals"]["n_docs"], "left_out": left,
               "examples": split_m.get("left_out_examples", [])}
    if records["read"] != records["scored"] + sum(left.values()) or s["train_records"]:
        raise AssertionError(f"{out}: records do not add up: {records} (train {s['train_records']})")
    if info.unk_id is not None:  # characters the tokenizer cannot spell are scored as <unk>: say how many
        records["unk_tokens"] = _count_unk(out / "eval", info.unk_id)
    return {"eval_dir": str(out / "eval"), "cache_key": key, "files": [[p, f] for p, f in resolved],
            "records": records}


def _count_unk(eval_dir: Path, unk_id: int) -> int:
    """Tokens equal to the unknown token in the cached shards (counted once, kept next to them)."""
    from s2t2_dist.utils.io import atomic_write_json, load_json

    from .reader import EvalDocs

    f = eval_dir.parent / "unk_tokens.json"
    if f.is_file():
        return int(load_json(f)["unk_tokens"])
    n = sum(int((d["input_ids"][1:] == unk_id).sum()) for d in EvalDocs(eval_dir))
    atomic_write_json(f, {"unk_id": unk_id, "unk_tokens": n})
    return n


def leave_out_beyond(records: dict, max_docs: int) -> dict:
    """The record counts when only the first ``max_docs`` documents are scored (0: all)."""
    if not max_docs or records["scored"] <= max_docs:
        return records
    left = dict(records["left_out"])
    left["max_docs"] = records["scored"] - max_docs
    return {**records, "scored": max_docs, "left_out": left}


def format_records(records: dict) -> str:
    """One line: records read, scored, and those left out by reason with the first few places."""
    n_left = sum(records["left_out"].values())
    line = f"records: read {records['read']:,}, scored {records['scored']:,}, left out {n_left:,}"
    if n_left:
        line += " (" + ", ".join(f"{k}: {v:,}" for k, v in sorted(records["left_out"].items())) + ")"
        ex = records.get("examples") or []
        if ex:
            line += "; first: " + ", ".join(f"{e['where']} {e['reason']}" for e in ex[:3])
    if records.get("unk_tokens"):
        line += f"; {records['unk_tokens']:,} scored tokens are <unk> (characters the tokenizer cannot spell)"
    return line
