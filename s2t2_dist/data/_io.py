"""Small atomic-write helpers (private to the data package)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator


def fsync_dir(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_open(final: str | Path, mode: str = "wb", **kw) -> Iterator[Any]:
    """Open ``final + '.tmp'`` for writing; on success fsync it and ``os.replace`` it onto ``final``.

    On an exception the temporary file is removed and ``final`` is untouched, so a crash never leaves a truncated
    file under its final name (a crash that kills the process may leave ``*.tmp``, which the next run overwrites).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    f = open(tmp, mode, **kw)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_json_atomic(path: str | Path, obj: Any) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")


def read_json(path: str | Path, what: str = "file") -> Any:
    from .errors import ManifestError

    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e}); the {what} is corrupt") from None


def append_journal(path: str | Path, entry: dict) -> None:
    """Append one JSON line and fsync it (a torn last line is ignored by ``read_journal``)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_journal(path: str | Path) -> list[dict]:
    """Entries of a journal; stops at the first torn or unparsable line (a crash mid-append)."""
    out: list[dict] = []
    path = Path(path)
    if not path.is_file():
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def rewrite_journal(path: str | Path, entries: list[dict]) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, sort_keys=True) + "\n")


def sha256_file(path: str | Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fingerprint(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj`` (sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
