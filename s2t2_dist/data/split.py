"""Step 1: one streaming pass over the input -> deterministic train/eval split, written as JSON-lines parts.

A record goes to eval iff ``blake2b(key, key=seed) / 2**64 < eval_fraction`` where key is its id (or its text with
``split_by="text"``): stable across runs, machines, input order and Python versions, and a record keeps its split
when the data set grows. Output, in ``output_dir``::

    train/part-00000.jsonl ...   {"id": ..., "text": ...} per line
    eval/part-00000.jsonl ...
    split.json                   parts, record/char counts, every filter decision counted, params (written last)
    _journal.jsonl               commit log used to resume a crashed run (kept for the record)

Every ``chunk_records`` input records both open parts are closed (written as ``*.tmp``, then renamed) and a journal
line is appended; re-running after a crash re-reads the input, skips the committed records without processing them,
and continues. Nothing already committed is rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from collections.abc import Iterable, Iterator

from s2t2_dist.utils.io import (
    AtomicFile, append_json_line, atomic_write_json, json_sha256, load_json, read_json_lines, sha256_file,
    write_json_lines)

from s2t2_dist.errors import ManifestError
from .records import RecordFilter, RecordPolicy, read_raw, resolve_inputs

SPLITS = ("train", "eval")
SPLIT_FORMAT = "s2t2-split"


def split_hash_u64(key: str, seed: int = 0) -> int:
    """64-bit keyed blake2b of ``key`` (the split decision uses it; independent of PYTHONHASHSEED)."""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=f"s2t2-split-{int(seed)}".encode())
    return int.from_bytes(h.digest(), "big")


def split_of(key: str, *, eval_fraction: float, seed: int = 0) -> str:
    """``"eval"`` or ``"train"`` for a record key (its id, or its text)."""
    return "eval" if split_hash_u64(key, seed) < eval_fraction * 2.0**64 else "train"


def _part_name(i: int) -> str:
    return f"part-{i:05d}.jsonl"


class _PartWriter:
    def __init__(self, directory: Path, index: int):
        self.out = AtomicFile(directory / _part_name(index), "w", encoding="utf-8")
        self.f = self.out.file
        self.records = 0
        self.chars = 0

    def write(self, rid: str, text: str) -> None:
        self.f.write(json.dumps({"id": rid, "text": text}, ensure_ascii=False))
        self.f.write("\n")
        self.records += 1
        self.chars += len(text)

    def commit(self) -> dict | None:
        if self.records == 0:
            self.out.abort()
            return None
        final = self.out.commit()
        return {"name": final.name, "records": self.records, "chars": self.chars, "file_bytes": final.stat().st_size}

    def abort(self) -> None:
        self.out.abort()


def split_dataset(  # noqa: C901 - one streaming pass: split, duplicates, resume checks
    *,
    inputs: list[str],
    output_dir: str | os.PathLike,
    format: str = "auto",
    id_column: str | None = "id",
    text_column: str = "sequence",
    hf_split: str = "train",
    text_mode: str = "line",
    policy: RecordPolicy | None = None,
    eval_fraction: float = 0.01,
    split_by: str = "id",
    seed: int = 0,
    chunk_records: int = 1_000_000,
    progress: bool = True,
) -> dict:
    """Split ``inputs`` into train/eval parts under ``output_dir``; returns the split manifest (also split.json).

    Resumes a half-finished run in the same directory; returns at once if it is already complete with the same
    parameters; raises ManifestError if the directory holds a split made with different parameters.
    """
    policy = policy or RecordPolicy()
    out = Path(output_dir)
    params = {
        "inputs": [[p, f] for p, f in resolve_inputs(inputs, format)],
        # by content, not size: an input rewritten with the same size is another input
        "input_sha256": [sha256_file(p) if os.path.isfile(p) else None for p, _ in resolve_inputs(inputs, format)],
        "id_column": id_column, "text_column": text_column, "hf_split": hf_split, "text_mode": text_mode,
        "policy": policy.to_dict(), "eval_fraction": eval_fraction, "split_by": split_by, "seed": seed,
        "chunk_records": chunk_records,
    }
    phash = json_sha256(params)
    manifest_path = out / "split.json"
    if manifest_path.exists():
        m = load_json(manifest_path, "split manifest", ManifestError)
        if m.get("params_hash") != phash:
            raise ManifestError(
                f"{manifest_path}: this directory holds a split made with different parameters or inputs; "
                "choose another output_dir or delete it")
        return m

    for s in SPLITS:
        (out / s).mkdir(parents=True, exist_ok=True)
    journal = out / "_journal.jsonl"
    entries = read_json_lines(journal)
    if len(entries) == 1 and entries[0].get("params_hash") != phash:
        entries = []  # a split that failed before committing anything (e.g. bad input, since fixed): start afresh
    if entries and entries[0].get("params_hash") != phash:
        raise ManifestError(
            f"{journal}: a half-finished split with different parameters or inputs is in {out}; "
            "choose another output_dir or delete it")
    # keep only commits whose parts are all present (a part may be lost if the disk was wiped between runs)
    commits = []
    for e in entries[1:]:
        if all((out / s / p["name"]).is_file() for s in SPLITS for p in e["parts"][s]):
            commits.append(e)
        else:
            break
    if len(commits) != len(entries) - 1 or not entries:
        write_json_lines(journal, [{"params_hash": phash, "started": time.time()}] + commits)

    stats = Counter(commits[-1]["stats"]) if commits else Counter()
    skip = commits[-1]["position"] if commits else 0
    parts: dict[str, list[dict]] = {s: [p for e in commits for p in e["parts"][s]] for s in SPLITS}
    chunk_index = len(commits)
    filt = RecordFilter(policy, stats, list(commits[-1].get("examples", [])) if commits else None)
    key_is_text = split_by == "text"

    raw: Iterator = read_raw(inputs, format=format, id_column=id_column, text_column=text_column,
                             hf_split=hf_split, text_mode=text_mode, allowed=policy.allowed(),
                             uppercase=policy.uppercase)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="split", unit="rec", initial=skip, dynamic_ncols=True)  # counts as integers
    position = 0
    writers = {s: _PartWriter(out / s, chunk_index) for s in SPLITS}
    pending = 0
    try:
        for rec in raw:
            position += 1
            if position <= skip:  # committed by an earlier run
                continue
            kept = filt(rec)
            if kept is not None:
                s = split_of(kept.text if key_is_text else kept.id, eval_fraction=eval_fraction, seed=seed)
                writers[s].write(kept.id, kept.text)
            pending += 1
            if pending >= chunk_records:
                _commit(out, journal, writers, parts, stats, position, chunk_index, filt.examples)
                chunk_index += 1
                writers = {s: _PartWriter(out / s, chunk_index) for s in SPLITS}
                if bar is not None:
                    bar.update(pending)
                pending = 0
        _commit(out, journal, writers, parts, stats, position, chunk_index, filt.examples)
        if bar is not None:
            bar.update(pending)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()

    n = {s: sum(p["records"] for p in parts[s]) for s in SPLITS}
    chars = {s: sum(p["chars"] for p in parts[s]) for s in SPLITS}
    manifest = {
        "format": SPLIT_FORMAT, "version": 1, "params_hash": phash, "params": params,
        "parts": parts, "records": n, "chars": chars,
        "stats": dict(sorted(stats.items())),
        "summary": summarize_stats(stats, n, chars),
        "left_out_examples": filt.examples,  # the first records skipped or filtered: where and why
    }
    atomic_write_json(manifest_path, manifest)
    return manifest


def _commit(out: Path, journal: Path, writers: dict, parts: dict, stats: Counter, position: int, index: int,
            examples: list) -> None:
    new = {}
    for s, w in writers.items():
        info = w.commit()
        new[s] = [info] if info else []
        parts[s].extend(new[s])
    append_json_line(journal, {"chunk": index, "position": position, "parts": new, "stats": dict(stats),
                               "examples": examples})


def summarize_stats(stats: Counter | dict, records: dict, chars: dict) -> dict:
    """Records read / kept / skipped by reason / filtered by rule, per split counts."""
    stats = Counter(stats)
    return {
        "records_read": stats.get("read", 0),
        "records_kept": stats.get("kept", 0),
        "skipped_bad": {k[4:]: v for k, v in sorted(stats.items()) if k.startswith("bad:")},
        "filtered": {k[9:]: v for k, v in sorted(stats.items()) if k.startswith("filtered:")},
        "replaced_residues": stats.get("replaced_residues", 0),
        "train_records": records.get("train", 0), "eval_records": records.get("eval", 0),
        "train_chars": chars.get("train", 0), "eval_chars": chars.get("eval", 0),
    }


def load_split(split_dir: str | os.PathLike) -> dict:
    """The split manifest of a finished step 1 (ManifestError if missing or if a part is missing)."""
    split_dir = Path(split_dir)
    m = load_json(split_dir / "split.json", "split manifest (run the split step first)", ManifestError)
    if m.get("format") != SPLIT_FORMAT:
        raise ManifestError(f"{split_dir / 'split.json'}: not a split manifest (format {m.get('format')!r})")
    for s in SPLITS:
        for p in m["parts"][s]:
            f = split_dir / s / p["name"]
            if not f.is_file():
                raise ManifestError(f"{f}: listed in {split_dir / 'split.json'} but missing")
            if f.stat().st_size != p["file_bytes"]:
                raise ManifestError(f"{f}: {f.stat().st_size} bytes, but split.json says {p['file_bytes']}")
    return m


def split_manifest_hash(split_dir: str | os.PathLike) -> str:
    return hashlib.sha256((Path(split_dir) / "split.json").read_bytes()).hexdigest()


def iter_split_docs(split_dir: str | os.PathLike, split: str, *, start: int = 0) -> Iterator[tuple[int, str, str]]:
    """(doc index, id, text) of a split, in order, starting at doc index ``start`` (whole parts are skipped)."""
    for idx, line in iter_split_lines(split_dir, split, start=start):
        obj = json.loads(line)
        yield idx, obj["id"], obj["text"]


def iter_split_lines(split_dir: str | os.PathLike, split: str, *, start: int = 0) -> Iterator[tuple[int, str]]:
    """(doc index, raw JSON line) of a split from doc ``start`` on."""
    split_dir = Path(split_dir)
    m = load_split(split_dir)
    base = 0
    for p in m["parts"][split]:
        n = p["records"]
        if base + n <= start:
            base += n
            continue
        seen = 0
        with open(split_dir / split / p["name"], encoding="utf-8") as f:
            for line in f:
                idx = base + seen
                seen += 1
                if idx >= start:
                    yield idx, line
        if seen != n:
            raise ManifestError(f"{split_dir / split / p['name']}: {seen} records, split.json says {n}")
        base += n


def iter_split_texts(split_dir: str | os.PathLike, split: str) -> Iterable[str]:
    for _, _, text in iter_split_docs(split_dir, split):
        yield text
