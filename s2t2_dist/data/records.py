"""Readers for every input format, one record type, and the record policy (alphabet, lengths, bad records).

Formats: FASTA (`fasta.py`), JSON lines, parquet, a Hugging Face dataset saved with `save_to_disk`, a hub dataset
(`datasets.load_dataset(..., streaming=True)`), and plain text (one document per line, per blank-line separated
paragraph, or per file). Column names come from the caller. All readers stream.

FORMATS is THE format registry: a new input format is one reader and one entry there; `prepare`'s data.format and
`evaluate`'s data.format (files only) take their choices from it (InputFormatName, FileFormatName).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from collections.abc import Callable, Iterable, Iterator

from s2t2_dist.errors import DataError, DataFormatError
from s2t2_dist.registry import Registry
from .fasta import _COMPRESSED_ERRORS, Record, compressed_error, open_binary, read_fasta

FASTA_EXT = (".fasta", ".fa", ".faa", ".fas", ".fna", ".fsa", ".seq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
TEXT_EXT = (".txt", ".text")
COMPRESS_EXT = (".gz", ".bz2", ".xz")


# ---------------------------------------------------------------------------------------------------------------
# input resolution


def _strip_compress(name: str) -> str:
    for c in COMPRESS_EXT:
        if name.endswith(c):
            return name[: -len(c)]
    return name


def is_hf_dataset_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in ("dataset_dict.json", "state.json", "dataset_info.json"))


def detect_format(path: str | Path) -> str:
    p = Path(path)
    if is_hf_dataset_dir(p):
        return "hf_disk"
    name = _strip_compress(p.name.lower())
    for fmt, spec in FORMATS.items():
        if spec.endings and name.endswith(spec.endings):
            return fmt
    raise DataError(f"{path}: cannot tell the format from the file name; set format to one of "
                    f"{', '.join(f for f in FORMATS if f != 'hub')}")


def resolve_inputs(inputs: Iterable[str], format: str = "auto") -> list[tuple[str, str]]:
    """Expand globs and directories into an ordered list of (path or hub id, format)."""
    out: list[tuple[str, str]] = []
    for item in inputs:
        if format == "hub":
            out.append((item, "hub"))
            continue
        if any(ch in item for ch in "*?["):
            paths = sorted(glob.glob(item))
            if not paths:
                raise DataError(f"inputs: the pattern {item!r} matches no file")
        else:
            paths = [item]
        for p in paths:
            if not os.path.exists(p):
                raise DataError(f"inputs: {p!r} does not exist")
            if os.path.isdir(p) and not (format == "hf_disk" or is_hf_dataset_dir(p)):
                files = sorted(str(f) for f in Path(p).rglob("*") if f.is_file() and not f.name.startswith("."))
                if format == "auto":
                    known = []
                    for f in files:
                        try:
                            known.append((f, detect_format(f)))
                        except DataError:
                            pass
                    if not known:
                        raise DataError(f"inputs: directory {p!r} holds no file of a known format")
                    out.extend(known)
                else:
                    out.extend((f, format) for f in files)
            else:
                out.append((p, detect_format(p) if format == "auto" else format))
    return out


# ---------------------------------------------------------------------------------------------------------------
# readers (yield Records, bad ones flagged; never raise for a bad record, always raise for an unreadable file)


def _check_columns(src: str, available: Iterable[str], id_column: str | None, text_column: str) -> None:
    available = list(available)
    missing = [c for c in (text_column, id_column) if c is not None and c not in available]
    if missing:
        raise DataFormatError(
            src, None,
            f"column {missing[0]!r} not found (available: {', '.join(map(str, available))}); "
            "set id_column / text_column to the names this dataset uses (id_column: null derives ids from positions)",
            reason="missing_column",
        )


def _table_record(row_id, text, src: str, row: int, unit: str, id_column: str | None) -> Record:
    if id_column is None:
        row_id = f"{os.path.basename(src)}:{row}"
    elif row_id is None or row_id == "":
        return Record("", None, src, row, unit, bad="missing_id", detail=f"empty {id_column!r}")
    if not isinstance(text, str):
        return Record(str(row_id), None, src, row, unit, bad="missing_text",
                      detail=f"text is {type(text).__name__}, not a string")
    return Record(str(row_id), text, src, row, unit)


def read_jsonl(path: str | Path, *, id_column: str | None, text_column: str) -> Iterator[Record]:
    src = str(path)
    lineno = 0
    first = True
    f = open_binary(path)
    try:
        try:
            for raw in f:
                lineno += 1
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    yield Record("", None, src, lineno, bad="bad_json", detail=f"not a JSON object: {e}")
                    continue
                if not isinstance(obj, dict):
                    yield Record("", None, src, lineno, bad="bad_json", detail="line is JSON but not an object")
                    continue
                if first:  # a wrong column name is a config error, not a bad record
                    _check_columns(f"{src}:{lineno}", obj.keys(), id_column, text_column)
                    first = False
                yield _table_record(obj.get(id_column) if id_column else None, obj.get(text_column), src, lineno,
                                    "line", id_column)
        except _COMPRESSED_ERRORS as e:
            raise compressed_error(src, lineno + 1, e) from None
    finally:
        f.close()


def read_text(path: str | Path, *, mode: str = "line") -> Iterator[Record]:
    """Plain UTF-8 text: one document per non-empty line, per blank-line separated paragraph, or per file."""
    src = str(path)
    name = os.path.basename(src)
    lineno = 0
    para: list[str] = []
    para_start = 0
    f = open_binary(path)
    try:
        try:
            for raw in f:
                lineno += 1
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    yield Record("", None, src, lineno, bad="not_utf8", detail=f"not valid UTF-8: {e}")
                    continue
                if mode == "line":
                    if line.strip():
                        yield Record(f"{name}:{lineno}", line, src, lineno)
                elif mode == "paragraph":
                    if line.strip():
                        if not para:
                            para_start = lineno
                        para.append(line)
                    elif para:
                        yield Record(f"{name}:{para_start}", "\n".join(para), src, para_start)
                        para = []
                else:
                    if not para:
                        para_start = 1
                    para.append(line)
        except _COMPRESSED_ERRORS as e:
            raise compressed_error(src, lineno + 1, e) from None
    finally:
        f.close()
    if mode == "paragraph" and para:
        yield Record(f"{name}:{para_start}", "\n".join(para), src, para_start)
    if mode == "file":
        text = "\n".join(para)
        if text.strip():
            yield Record(name, text, src, 1)
        else:
            yield Record(name, None, src, 1, bad="empty_record", detail="file is empty")


def read_parquet(path: str | Path, *, id_column: str | None, text_column: str, batch_size: int = 8192) -> Iterator[Record]:
    import pyarrow.parquet as pq

    src = str(path)
    try:
        pf = pq.ParquetFile(src)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError/... for corrupt files
        raise DataFormatError(src, None, f"not a readable parquet file ({type(e).__name__}: {e})") from None
    _check_columns(src, pf.schema_arrow.names, id_column, text_column)
    cols = [text_column] + ([id_column] if id_column else [])
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=cols):
        texts = batch.column(text_column).to_pylist()
        ids = batch.column(id_column).to_pylist() if id_column else [None] * len(texts)
        for rid, text in zip(ids, texts):
            row += 1
            yield _table_record(rid, text, src, row, "row", id_column)


def _iter_hf(ds, src: str, id_column: str | None, text_column: str) -> Iterator[Record]:
    names = ds.column_names
    _check_columns(src, names, id_column, text_column)
    cols = [text_column] + ([id_column] if id_column else [])
    row = 0
    for batch in ds.select_columns(cols).iter(batch_size=4096):
        texts = batch[text_column]
        ids = batch[id_column] if id_column else [None] * len(texts)
        for rid, text in zip(ids, texts):
            row += 1
            yield _table_record(rid, text, src, row, "row", id_column)


def read_hf_disk(path: str | Path, *, id_column: str | None, text_column: str, split: str = "train") -> Iterator[Record]:
    import datasets

    src = str(path)
    try:
        ds = datasets.load_from_disk(src)
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a damaged directory
        raise DataFormatError(src, None, f"not a dataset saved with save_to_disk ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataFormatError(src, None, f"split {split!r} not in the dataset (has: {', '.join(ds)}); set hf_split")
        ds = ds[split]
    yield from _iter_hf(ds, src, id_column, text_column)


def read_hub(name: str, *, id_column: str | None, text_column: str, split: str = "train") -> Iterator[Record]:
    """A hub dataset, streamed (needs network access; not exercised by the tests)."""
    import datasets

    ds = datasets.load_dataset(name, split=split, streaming=True)
    first = True
    row = 0
    for ex in ds:
        row += 1
        if first:
            _check_columns(name, ex.keys(), id_column, text_column)
            first = False
        yield _table_record(ex.get(id_column) if id_column else None, ex.get(text_column), name, row, "row", id_column)


def read_raw(inputs: Iterable[str], *, format: str = "auto", id_column: str | None = "id",
             text_column: str = "sequence", hf_split: str = "train", text_mode: str = "line",
             allowed: str | None = None, uppercase: bool = False) -> Iterator[Record]:
    """Every record of every input, in order, bad ones flagged (``Record.bad``)."""
    opts = ReadOptions(id_column, text_column, hf_split, text_mode, allowed, uppercase)
    for path, fmt in resolve_inputs(inputs, format):
        yield from FORMATS.lookup(fmt, f"format (for {path})").read(path, opts)


@dataclass(frozen=True)
class ReadOptions:
    """What the caller says about its inputs; each format reads the options that concern it."""

    id_column: str | None
    text_column: str
    hf_split: str
    text_mode: str
    allowed: str | None
    uppercase: bool


@dataclass(frozen=True)
class InputFormat:
    #: (path or hub id, ReadOptions) -> the records, in order, bad ones flagged
    read: Callable[[str, ReadOptions], Iterator[Record]]
    #: file-name endings (after a compression suffix) that select this format under format=auto
    endings: tuple[str, ...] = ()
    #: read from files, so raw evaluation (`evaluate data.files=...`) can score it
    files: bool = True


#: THE format registry (format name -> reader); the order is detect_format's
FORMATS: Registry = Registry("input format", {
    "fasta": InputFormat(lambda p, o: read_fasta(p, allowed=o.allowed, uppercase=o.uppercase), FASTA_EXT),
    "jsonl": InputFormat(lambda p, o: read_jsonl(p, id_column=o.id_column, text_column=o.text_column), JSONL_EXT),
    "parquet": InputFormat(lambda p, o: read_parquet(p, id_column=o.id_column, text_column=o.text_column),
                           (".parquet",)),
    "hf_disk": InputFormat(lambda p, o: read_hf_disk(p, id_column=o.id_column, text_column=o.text_column,
                                                     split=o.hf_split), files=False),
    "hub": InputFormat(lambda p, o: read_hub(p, id_column=o.id_column, text_column=o.text_column, split=o.hf_split),
                       files=False),
    "text": InputFormat(lambda p, o: read_text(p, mode=o.text_mode), TEXT_EXT),
})
#: the `format` key of prepare (data.format) and of evaluate's raw files: auto or a registered format
InputFormatName = Literal[("auto", *FORMATS)]  # type: ignore[valid-type]
FileFormatName = Literal[("auto", *(f for f, spec in FORMATS.items() if spec.files))]  # type: ignore[valid-type]


# ---------------------------------------------------------------------------------------------------------------
# record policy


@dataclass
class RecordPolicy:
    """What a record may contain and what happens otherwise.

    alphabet: allowed letters (None: anything). extra_residues: letters also accepted, handled by
    extra_residue_policy: keep | replace (by ``replacement``) | skip (filtered, counted) | error.
    on_bad_record: malformed records (see `fasta.py`) raise (``error``) or are skipped and counted (``skip``).
    """

    alphabet: str | None = None
    extra_residues: str = ""
    extra_residue_policy: str = "keep"
    replacement: str = "X"
    uppercase: bool = False
    min_length: int = 1
    max_length: int | None = None
    on_bad_record: str = "error"

    def allowed(self) -> str | None:
        if self.alphabet is None:
            return None
        return "".join(sorted(set(self.alphabet) | set(self.extra_residues)))

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


class RecordFilter:
    """Apply a RecordPolicy to raw records, counting every decision in ``stats`` (a Counter).

    Counter keys: ``read``, ``kept``, ``bad:<reason>`` (skipped malformed records), ``filtered:<rule>``
    (too_short, too_long, extra_residue), ``replaced_residues``. ``examples``: the first `MAX_EXAMPLES` records
    left out, ``{"where": FILE:LINE, "id", "reason", "detail"}``, so a report can say which ones.
    """

    MAX_EXAMPLES = 10

    def __init__(self, policy: RecordPolicy, stats: Counter | None = None, examples: list | None = None):
        self.policy = policy
        self.stats = stats if stats is not None else Counter()
        self.examples = examples if examples is not None else []
        allowed = policy.allowed()
        self._checked = (allowed, policy.uppercase)
        self._bad_re = None if allowed is None else re.compile("[^" + re.escape(allowed) + "]")
        extras = "".join(sorted(set(policy.extra_residues) - set(policy.alphabet or "")))
        self._extra_re = re.compile("[" + re.escape(extras) + "]") if (extras and policy.alphabet) else None
        self._extra_table = str.maketrans({c: policy.replacement for c in extras}) if extras else None

    def _bad(self, rec: Record) -> None:
        if self.policy.on_bad_record == "error":
            raise rec.error()
        self.stats["bad:" + rec.bad] += 1
        self._left_out(rec, "bad:" + rec.bad, rec.detail)

    def _left_out(self, rec: Record, reason: str, detail: str | None = None) -> None:
        if len(self.examples) < self.MAX_EXAMPLES:
            self.examples.append({"where": rec.where(), "id": rec.id, "reason": reason, "detail": detail})

    def __call__(self, rec: Record) -> Record | None:
        """The record to keep (text possibly normalised), or None (counted). Raises DataFormatError on "error"."""
        st = self.stats
        st["read"] += 1
        if rec.bad is not None:
            self._bad(rec)
            return None
        text = rec.text
        if rec.checked != self._checked:
            # FASTA is checked line by line by its reader (exact line and column); everything else here
            if self.policy.uppercase:
                text = text.upper()
            if self._bad_re is not None:
                m = self._bad_re.search(text)
                if m is not None:
                    rec.bad, rec.detail = "bad_character", (
                        f"character {m.group()!r} at position {m.start() + 1} of record {rec.id!r} is not in the "
                        "allowed alphabet")
                    self._bad(rec)
                    return None
        if not text:
            rec.bad, rec.detail = "empty_record", f"record {rec.id!r} has no text"
            self._bad(rec)
            return None
        if self._extra_re is not None and self.policy.extra_residue_policy != "keep":
            m = self._extra_re.search(text)
            if m is not None:
                pol = self.policy.extra_residue_policy
                if pol == "error":
                    raise DataFormatError(rec.source, rec.pos if rec.unit == "line" else None,
                                          f"record {rec.id!r} contains {m.group()!r} at residue {m.start() + 1} "
                                          "(extra_residue_policy: error)", reason="extra_residue")
                if pol == "skip":
                    st["filtered:extra_residue"] += 1
                    self._left_out(rec, "filtered:extra_residue", f"{m.group()!r} at residue {m.start() + 1}")
                    return None
                new = text.translate(self._extra_table)
                st["replaced_residues"] += sum(1 for a, b in zip(text, new) if a != b)
                text = new
        n = len(text)
        if n < self.policy.min_length:
            st["filtered:too_short"] += 1
            self._left_out(rec, "filtered:too_short", f"{n} < min_length {self.policy.min_length}")
            return None
        if self.policy.max_length is not None and n > self.policy.max_length:
            st["filtered:too_long"] += 1
            self._left_out(rec, "filtered:too_long", f"{n} > max_length {self.policy.max_length}")
            return None
        st["kept"] += 1
        rec.text = text
        return rec
