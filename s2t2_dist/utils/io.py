"""Atomic file writes and small JSON helpers: a crash or a full disk never leaves a half-written file under its
final name.

Two kinds of temporary name:
- `atomic_path` / `atomic_write_*`: a unique name (``.NAME.XXXX.tmp``), for files several processes may write;
- `AtomicFile` / `atomic_open` / `atomic_dir`: the stable name ``NAME.tmp``, for outputs a single writer owns and
  re-creates when it is re-run: a leftover of a killed run is simply overwritten by the next one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Iterator
from s2t2_dist.errors import WriteError


def write_error(final: str | Path, err: BaseException) -> WriteError | None:
    """A WriteError naming `final` when `err` is a failed write on a full (or quota-limited) disk, else None.
    Libraries report a full disk in their own words: safetensors "No space left on device (os error 28)", torch.save
    "unexpected pos" / "file write failed"; so the free space decides too."""
    import errno

    final = Path(final)
    text = f"{err}"
    codes = {e.errno for e in (err, err.__cause__, err.__context__) if isinstance(e, OSError) and e.errno}
    where = final.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    full = bool(codes & {errno.ENOSPC, errno.EDQUOT}) or "No space left" in text or "os error 28" in text \
        or (free is not None and free < (1 << 20) and ("unexpected pos" in text or "write failed" in text))
    if not full:
        return None
    return WriteError(errno.ENOSPC, f"writing {final} failed: the disk is full ({free:,} bytes free on the "
                      f"filesystem of {where}); nothing was replaced ({final.name} is as before, if it existed); "
                      "free space and run the same command again")


@contextlib.contextmanager
def build_lock(path: str | Path, on_wait=None) -> Iterator[None]:
    """An exclusive lock (flock) on the file ``path``, held for the block: a second builder of the same thing
    waits for the first (``on_wait(pid)`` is called once, with the holder's pid, before it waits). The OS drops the
    lock of a process that dies, so a killed build never blocks the next."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(os.pread(fd, 32, 0).decode(errors="replace").strip() or "?")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_path(final: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `final`; on success it is fsynced and renamed over `final`.

    On any exception the temporary file or directory is removed and `final` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix + ".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_file():
            with open(tmp_path, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException as e:
        _remove(tmp_path)
        full = write_error(final, e) if isinstance(e, Exception) and not isinstance(e, WriteError) else None
        if full is not None:
            raise full from e
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 1) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


class AtomicFile:
    """A file opened for writing as ``final.tmp``; `commit()` flushes, fsyncs and renames it onto `final` (and
    fsyncs the directory), `abort()` closes and removes it. Usable as a context manager (commit on success, abort
    on an exception), or held open across calls when the writer decides later when the file is complete.

    ``file`` is the open file object (``open(tmp, mode, **open_kw)``).
    """

    def __init__(self, final: str | Path, mode: str = "wb", **open_kw):
        if not mode.startswith("w"):
            raise ValueError(f"AtomicFile writes a new file: mode must start with 'w', got {mode!r}")
        self.final = Path(final)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        self.file = open(self.tmp, mode, **open_kw)

    def commit(self) -> Path:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return self.final

    def abort(self) -> None:
        try:
            self.file.close()
        except OSError:  # close() flushes the buffer, which fails again on a full disk: the file is discarded anyway
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.tmp.unlink()

    def __enter__(self):
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def atomic_open(final: str | Path, mode: str = "wb", **open_kw) -> AtomicFile:
    """``with atomic_open(path, "w", encoding="utf-8") as f: ...``: `final` appears whole, or not at all."""
    return AtomicFile(final, mode, **open_kw)


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield an empty directory ``final.tmp`` to fill; on success it replaces `final` (a previous `final` is moved
    aside first and deleted after). On an exception it is removed and `final` is untouched."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            _remove(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        _remove(old)
    except BaseException:
        _remove(tmp)
        raise


# ---------------------------------------------------------------------------------------------------------------
# JSON-lines logs (append one fsynced line per event; a torn last line from a crash is ignored on reading)


def append_json_line(path: str | Path, entry: Any) -> None:
    """Append one JSON line to `path` and fsync it."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json_lines(path: str | Path) -> list:
    """The entries of a JSON-lines log, up to the first torn or unparsable line (a crash mid-append); [] if the
    file does not exist."""
    out: list = []
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


def write_json_lines(path: str | Path, entries: list) -> None:
    """Replace `path` atomically by these entries, one JSON line each."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, sort_keys=True) + "\n")


def load_json(path: str | Path, what: str = "file", error: type[Exception] = ValueError) -> Any:
    """Parse a JSON file; a missing or unparsable file raises `error` naming the path and `what` it should be."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); the {what} is corrupt") from None


# ---------------------------------------------------------------------------------------------------------------
# hashes


def sha256_file(path: str | Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(bufsize):
            h.update(b)
    return h.hexdigest()


def json_sha256(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys, no whitespace): a fingerprint of a parameter set."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def not_a_file(path: str | Path) -> str | None:
    """What ``path`` is when it is not a regular file ("does not exist", "a directory", "a FIFO (named pipe)", ...);
    None for a regular file (after symbolic links). Said in messages instead of a generic "not found", and checked
    before opening: opening a FIFO waits for a writer."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"
