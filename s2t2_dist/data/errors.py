"""Errors raised by the data pipeline. Each names the file (and line, or shard) it is about."""

from __future__ import annotations


class DataError(ValueError):
    """Base class of data-pipeline errors."""


class DataFormatError(DataError):
    """Malformed input: the message starts with ``FILE:LINE:`` (or ``FILE: row N:`` for tables)."""

    def __init__(self, path, line: int | None, message: str, *, reason: str | None = None):
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class ShardError(DataError):
    """A shard is missing, truncated, corrupt or does not hold what its manifest says. Names the shard."""


class ManifestError(DataError):
    """A manifest is missing, malformed, or does not match its shards / its input / a resumed run."""
