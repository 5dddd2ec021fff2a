"""Streaming FASTA reader (UniRef50 / UniProt releases, plain or gzip/bz2/xz-compressed).

Reads line by line (never the whole file), joins wrapped sequence lines, and takes the record id from the first
whitespace-separated token of the header, so all of these work:

    >UniRef50_A0A5A9P0L4 Peptidylprolyl isomerase n=1 Tax=Triplophysa tibetana TaxID=1572043 RepID=A0A5A9P0L4_9TELE
    >UniRef50_A0A1E3NP16
    >tr|A7TBS3|A7TBS3_NEMVE Predicted protein (Fragment) OS=Nematostella vectensis ...

Problems are not raised here: the reader yields a `Record` whose ``bad`` names the reason (``sequence_before_header``,
``empty_record``, ``missing_id``, ``bad_character``, ``not_utf8``) and whose ``pos`` is the offending line, and the
record policy (`records.RecordFilter`) raises a `DataFormatError` naming FILE:LINE or counts the skip. A truncated or
corrupt compressed file always raises (the last record cannot be trusted).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import re
import zlib
from pathlib import Path
from typing import BinaryIO
from collections.abc import Iterator

from s2t2_dist.errors import DataFormatError


class Record:
    """One input record. ``bad`` is None for a well-formed record, else the reason it is malformed."""

    __slots__ = ("id", "text", "source", "pos", "unit", "bad", "detail", "checked")

    def __init__(self, id, text, source, pos, unit="line", bad=None, detail=None, checked=None):
        self.id = id
        self.text = text
        self.source = source
        self.pos = pos  # 1-based line (or row) of the record, or of the problem when ``bad``
        self.unit = unit  # "line" or "row"
        self.bad = bad
        self.detail = detail
        self.checked = checked  # (allowed, uppercase) the reader already enforced, or None

    def where(self) -> str:
        return f"{self.source}:{self.pos}" if self.unit == "line" else f"{self.source}: row {self.pos}"

    def error(self) -> DataFormatError:
        if self.unit == "line":
            return DataFormatError(self.source, self.pos, self.detail or self.bad, reason=self.bad)
        return DataFormatError(self.source, None, f"row {self.pos}: {self.detail or self.bad}", reason=self.bad)

    def __repr__(self) -> str:
        t = self.text if self.text is None or len(self.text) < 40 else self.text[:37] + "..."
        return f"Record(id={self.id!r}, text={t!r}, at={self.where()}, bad={self.bad!r})"


def open_binary(path: str | Path) -> BinaryIO:
    """Open a possibly compressed file for binary reading; gzip is recognised by its magic bytes."""
    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    if magic[:3] == b"BZh":
        return bz2.open(path, "rb")
    if magic[:6] == b"\xfd7zXZ\x00":
        return lzma.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


_COMPRESSED_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, OSError, lzma.LZMAError)


def compressed_error(path, line: int, exc: BaseException) -> DataFormatError:
    if isinstance(exc, EOFError):
        msg = f"truncated compressed file: the stream ends before its end marker ({exc}); re-download or re-copy it"
    else:
        msg = f"corrupt or unreadable compressed data ({type(exc).__name__}: {exc})"
    return DataFormatError(path, line, msg, reason="truncated_file")


def lines(f: BinaryIO, chunk: int = 1 << 16) -> Iterator[bytes]:
    """The lines of a binary stream, each ending in b"\\n" (the last may not), whatever the line endings: LF,
    CRLF, or the CR alone of old Mac editors (which `for line in f` would read as one line). A UTF-8 byte-order
    mark at the start is dropped."""
    buf = f.read(3)
    if buf == b"\xef\xbb\xbf":
        buf = b""
    buf += f.read(chunk)
    while buf:
        more = f.read(chunk)
        if buf.endswith(b"\r") and more:  # a CRLF may be cut between two chunks
            buf, more = buf[:-1], b"\r" + more
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        parts = buf.split(b"\n")
        for p in parts[:-1]:
            yield p + b"\n"
        buf = parts[-1] + more
        if not more:
            if buf:
                yield buf
            return


def _disallowed_re(allowed: str | None) -> re.Pattern | None:
    if allowed is None:
        return None
    return re.compile(b"[^" + re.escape(allowed.encode("ascii")) + b"]")


def read_fasta(path: str | Path, *, allowed: str | None = None, uppercase: bool = False) -> Iterator[Record]:  # noqa: C901 - a streaming parser's states (header, sequence, bad record) in one pass
    """Yield the records of a FASTA file in order (bad ones flagged, see module doc).

    ``allowed``: the letters a sequence may contain (None: any printable text); checked line by line so a bad
    character is reported with its exact line and column.
    """
    src = str(path)
    bad_re = _disallowed_re(allowed)
    lineno = 0
    header: bytes | None = None
    header_line = 0
    parts: list[bytes] = []
    problem: tuple[str, int, str] | None = None  # (reason, line, detail)
    orphan_line = 0  # first line of sequence text seen before any header

    def finish() -> Record:
        rid = header.split(None, 1)[0].decode("utf-8", "replace") if header.strip() else ""
        if problem is not None:
            return Record(rid, None, src, problem[1], bad=problem[0], detail=problem[2])
        if not rid:
            return Record(rid, None, src, header_line, bad="missing_id", detail="header line has no id after '>'")
        if not parts:
            return Record(rid, None, src, header_line, bad="empty_record", detail=f"record {rid!r} has no sequence")
        seq = b"".join(parts)
        try:
            text = seq.decode("utf-8") if bad_re is None else seq.decode("ascii")
        except UnicodeDecodeError as e:
            return Record(rid, None, src, header_line, bad="not_utf8", detail=f"record {rid!r} is not valid UTF-8: {e}")
        return Record(rid, text, src, header_line, checked=checked)

    checked = (allowed, uppercase)
    f = open_binary(path)
    try:
        try:
            for raw in lines(f):
                lineno += 1
                if raw[:1] == b">":
                    if header is not None:
                        yield finish()
                    elif orphan_line:
                        yield Record("", None, src, orphan_line, bad="sequence_before_header",
                                     detail="sequence data before the first '>' header line")
                        orphan_line = 0
                    header = raw[1:].strip()
                    header_line = lineno
                    parts = []
                    problem = None
                    continue
                s = raw.strip()
                if not s:
                    continue
                if header is None:
                    if not orphan_line:
                        orphan_line = lineno
                    continue
                if uppercase:
                    s = s.upper()
                if bad_re is not None and problem is None:
                    m = bad_re.search(s)
                    if m is not None:
                        ch = m.group().decode("latin-1")
                        problem = ("bad_character", lineno,
                                   f"character {ch!r} at column {m.start() + 1} is not in the allowed alphabet "
                                   f"(record {header.split(None, 1)[0].decode('utf-8', 'replace') if header.strip() else '?'!r})")
                parts.append(s)
        except _COMPRESSED_ERRORS as e:
            raise compressed_error(src, lineno + 1, e) from None
        if header is not None:
            yield finish()
        elif orphan_line:
            yield Record("", None, src, orphan_line, bad="sequence_before_header",
                         detail="sequence data but no '>' header line in the file")
    finally:
        f.close()
