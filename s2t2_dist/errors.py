"""Every user error of the project, in one place.

A user error is about the user's inputs or the run's state (a config key, an environment variable, a file, a
checkpoint), and its message says what is wrong and names the key, variable or file. Entry points
(`stages.common.run_main`) print it as one line and exit with code 2; anything else is a bug and keeps its
traceback. A new user error subclasses :class:`UserError` (or one of the classes below) here.
"""

from __future__ import annotations


class UserError(Exception):
    """Base of every user error: reported as one line, exit code 2."""


# -- configuration and environment ------------------------------------------------------------------------------


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the dotted key (and the file, when there is one)."""


class EnvError(ConfigError):
    """An ``S2T2_*`` environment variable has a value this package cannot use; the message names it."""


class FaultSpecError(UserError, ValueError):
    """``S2T2_FAULT`` does not parse (fault_spec.py's grammar)."""


class RunDirError(ConfigError):
    """The output directory is used by another run, owned by another run, or cannot be written."""


# -- models and initialisation ----------------------------------------------------------------------------------


class UnsupportedModel(ConfigError):
    """A causal LM whose embedding / head S2T2 cannot translate (a head with a bias, no separate input embedding
    and head of one shape, scaled logits): a user error, said in one line."""


class ModelLoadError(ConfigError):
    """A model directory whose weights and config.json disagree (tensors missing, unused or of other shapes): the
    model would run with random parts; said in one line naming the directory."""


class SourceModelError(UserError, RuntimeError):
    """The source model cannot be obtained or converted (download, checksum, missing `gguf`): a one-line error."""


class InitError(UserError, ValueError):
    """The initialisation cannot be built as configured (incompatible P file, tokenizer, model)."""


class PFileError(UserError, ValueError):
    """A P file is missing, malformed, or does not fit the run (its shapes, kind or tokenizers)."""


# -- data -------------------------------------------------------------------------------------------------------


class DataError(UserError, ValueError):
    """Base class of data-pipeline errors; each names the file (and line, or shard) it is about."""


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


# -- the run's state ----------------------------------------------------------------------------------------------


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (another run's, another layout's, incomplete)."""


class CheckpointCorrupt(CheckpointError):
    """A complete checkpoint whose files are missing, truncated or unreadable."""


class TooManyBadSteps(UserError, RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient: the run stops with what to change."""


class NonFiniteParameters(UserError, RuntimeError):
    """An update left a trained parameter NaN or infinite (a step too large for it): the run stops before that
    state is checkpointed."""


class WriteError(UserError, OSError):
    """Writing an output failed for a reason outside the program (a full disk, a quota): one line naming the file."""
