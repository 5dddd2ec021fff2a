"""The one reader of the ``S2T2_*`` environment variables: every variable the package and ``slurm/`` read is declared
here (name, type, default, meaning), read through :func:`get` and checked by :func:`check` before any work.

A bad value is one line naming the variable (``EnvError``, a ConfigError: ``run_main`` prints it, exit code 2).
Booleans take the usual spellings in any case (1/0, true/false, yes/no, on/off). The batch scripts validate and
read through the same code: ``python -m s2t2_dist.envvars check`` (exit 2 with the line) and
``python -m s2t2_dist.envvars get NAME`` (the value as the shell uses it: booleans as 1/0).

docs/environment.md lists the variables (tests/core/test_envvars.py checks it names each one). Imports no torch:
the batch shell calls it before srun.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from s2t2_dist.errors import EnvError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
#: variables earlier versions read and this one ignores: a warning names them (the setting no longer does anything)
REMOVED = {
    "S2T2_NATIVE": "the native C kernels were removed; the product runs in torch (or Triton on CUDA)",
    "S2T2_NATIVE_CACHE": "the native C kernels and their build cache were removed",
    "S2T2_PRODUCT_KERNEL": "the kernel choice was removed with the native kernels; the product picks its route itself",
}
#: read by the test suite (tests/), not by s2t2: neither warned about nor refused as a typo
TEST_NAMES = ("S2T2_FAULTS_SEED", "S2T2_FAULTS_ROUNDS", "S2T2_FAULTS_LEDGER", "S2T2_SHARED_DATA",
              "S2T2_TEST_NO_SHARED_DATA", "S2T2_TEST_TIMELINE", "S2T2_KEEP_SLURM", "S2T2_EVIL_MARK")
log = logging.getLogger("s2t2.env")


@dataclass(frozen=True)
class Var:
    name: str
    kind: str  # bool | int | port | choice | path | text | log_level | backend | fault
    default: Any
    meaning: str
    where: str = "package"  # package: read by s2t2_dist; slurm: read by slurm/*.sh (through this module)
    choices: tuple[str, ...] = ()
    minimum: int | None = None


VARS: dict[str, Var] = {v.name: v for v in (
    Var("S2T2_LOG_LEVEL", "log_level", "INFO",
        "log level of every stage: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case), or a number"),
    Var("S2T2_TRACEBACK", "bool", False,
        "show the full traceback of a user error (bad config, data, P file, ...) instead of its one line"),
    Var("S2T2_DEVICE", "choice", "auto",
        "cpu: run on CPU with gloo even where GPUs are present (tests, CPU-only runs on a GPU node); auto: GPUs "
        "when present", choices=("auto", "cpu")),
    Var("S2T2_DIST_BACKEND", "backend", "",
        "torch.distributed backend, overriding the default (gloo on CPU; cpu:gloo,cuda:nccl with GPUs), e.g. "
        "cuda:gloo; nccl needs CUDA"),
    Var("S2T2_MASTER_ADDR", "text", "",
        "rendezvous address of a SLURM job (default: the NodeAddr of the allocation's first node)"),
    Var("S2T2_MASTER_PORT", "port", 0,
        "rendezvous port of a SLURM job, 1-65535 (default: 20000 + job id % 12000, below Linux's ephemeral ports)"),
    Var("S2T2_CACHE_DIR", "path", "",
        "the project's cache (default ~/.cache/s2t2): evaluate's tokenized data.files (CACHE/tokenized), source "
        "models (CACHE/source_lm, CACHE/downloads); a directory"),
    Var("S2T2_SYNC_DEBUG", "choice", "",
        "on CUDA, error or warn: torch.cuda.set_sync_debug_mode for the training steps that read nothing back "
        "(bench/gpu_smoke.py)", choices=("", "error", "warn")),
    Var("S2T2_FAULT", "fault", "",
        "fault injection for tests/faults (s2t2_dist/faults.py): ACTION:N[@RANK],...; unset in real runs"),
    Var("S2T2_FAULT_TRACE", "path", "",
        "tests/faults: directory every rank appends its JSON trace lines to (s2t2_dist/faults.py)"),
    Var("S2T2_STEP_REPORT_DIR", "path", "",
        "set by slurm/common.sh for each job step: rank 0 of a finished run writes `finished` there, so that a "
        "time-limit warning arriving during the final export or after it does not requeue a finished run"),
    # read by slurm/common.sh and the slurm/*.sh scripts
    Var("S2T2_HOME", "path", "", "repository root holding slurm/ and launch/ (default: the folder sbatch ran "
        "from)", where="slurm"),
    Var("S2T2_PYTHON", "text", "", "python interpreter of the batch scripts (default: python, else python3)",
        where="slurm"),
    Var("S2T2_ENTRY", "text", "", "what python runs instead of the stage, e.g. \"-m s2t2_dist.cluster.probe\"",
        where="slurm"),
    Var("S2T2_CONFIG", "text", "", "the stage's YAML config (each script has a default)", where="slurm"),
    Var("S2T2_SRUN_ARGS", "text", "", "extra srun options, e.g. \"--cpu-bind=cores\"", where="slurm"),
    Var("S2T2_LAUNCHER", "choice", "srun", "srun: one task per GPU; deepspeed: one deepspeed launcher per node",
        where="slurm", choices=("srun", "deepspeed")),
    Var("S2T2_GPUS_PER_NODE", "int", 0, "GPUs per node for S2T2_LAUNCHER=deepspeed (default: SLURM's "
        "--gpus-per-node, else the tasks per node)", where="slurm", minimum=1),
    Var("S2T2_REQUEUE", "bool", True, "requeue the job after it stopped with a checkpoint for the time limit "
        "(no/false/off/0: never requeue)", where="slurm"),
    Var("S2T2_MAX_RESTARTS", "int", 50, "stop requeueing after this many restarts (a whole number >= 0)",
        where="slurm", minimum=0),
)}


def _bool(v: Var, raw: str) -> bool:
    s = raw.strip().lower()
    if s in TRUE:
        return True
    if s in FALSE:
        return False
    raise EnvError(f"{v.name}={raw!r}: expected a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)}, any case)")


def _int(v: Var, raw: str, lo: int | None, hi: int | None = None, what: str = "a whole number") -> int:
    try:
        n = int(raw.strip(), 10)
    except ValueError:
        raise EnvError(f"{v.name}={raw!r}: expected {what}") from None
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        rng = f"{lo}-{hi}" if hi is not None else f">= {lo}"
        raise EnvError(f"{v.name}={raw!r}: out of range ({what} {rng})")
    return n


def _log_level(v: Var, raw: str) -> int | str:
    s = raw.strip().upper()
    if s == "WARN":
        s = "WARNING"
    if s in LOG_LEVELS:
        return s
    if s.isascii() and s.isdigit():  # int() takes other scripts' digits too; logging wants a plain number
        return int(s)
    raise EnvError(f"{v.name}={raw!r}: expected one of {', '.join(LOG_LEVELS)} (any case) or a number")


def _backend(v: Var, raw: str) -> str:
    """``BACKEND`` or ``DEVICE:BACKEND,...`` as torch.distributed takes it; nccl only where CUDA is."""
    s = raw.strip().lower()
    for part in s.split(","):
        dev, _, be = part.strip().rpartition(":")
        if be not in BACKENDS or (dev and dev not in ("cpu", "cuda", "xpu")):
            raise EnvError(f"{v.name}={raw!r}: expected a backend ({', '.join(BACKENDS)}) or DEVICE:BACKEND pairs "
                           "such as cpu:gloo,cuda:nccl")
    _backend_built(v, raw, s)
    if "nccl" in s:
        import torch  # only here: the check of a setting that needs CUDA

        if not torch.cuda.is_available():
            raise EnvError(f"{v.name}={raw!r}: nccl needs CUDA GPUs and this machine has none (torch.cuda is "
                           "unavailable); use gloo, or unset it")
        if get("S2T2_DEVICE") == "cpu":
            raise EnvError(f"{v.name}={raw!r}: nccl needs CUDA but S2T2_DEVICE=cpu runs on the CPU; use gloo")
    return s


def _backend_built(v: Var, raw: str, s: str) -> None:
    """A backend this torch was built without fails in every rank's init_process_group: said here, before any rank
    starts."""
    import torch.distributed as dist

    for be in ("mpi", "ucc", "xccl"):
        if be in s and not getattr(dist, f"is_{be}_available", lambda: False)():
            raise EnvError(f"{v.name}={raw!r}: this torch {torch_version()} was built without {be} support "
                           f"(torch.distributed.is_{be}_available() is false); use gloo (CPU) or nccl (CUDA), or "
                           "unset it")


def torch_version() -> str:
    import torch

    return torch.__version__


def _path(v: Var, raw: str) -> str:
    """A directory the package writes into: absent (created when needed) or a directory, not a file."""
    if "\0" in raw:
        raise EnvError(f"{v.name}={raw!r}: holds a NUL byte, which no path can")
    try:
        p = Path(raw).expanduser()
        q = p
        while not q.exists() and q != q.parent:
            q = q.parent
        if q.exists() and not q.is_dir():
            kind = "a file" if q.is_file() else "not a directory (a device, pipe or socket)"
            what = f"is {kind}" if q == p else f"is below {q}, which is {kind}"
            raise EnvError(f"{v.name}={raw}: {what}, not a directory; point it at a directory")
    except (OSError, RuntimeError) as e:  # a name too long, ~user of no such user
        raise EnvError(f"{v.name}={raw!r}: not a usable path ({e})") from None
    return str(p)


def _fault(v: Var, raw: str) -> str:
    from s2t2_dist.fault_spec import parse  # tests only: set by the fault suite
    from s2t2_dist.errors import FaultSpecError

    try:
        parse(raw)
    except FaultSpecError as e:
        raise EnvError(str(e)) from None
    return raw


_PARSERS: dict[str, Callable[[Var, str], Any]] = {
    "bool": _bool,
    "int": lambda v, raw: _int(v, raw, v.minimum),
    "port": lambda v, raw: _int(v, raw, 1, 65535, "a port number"),
    "choice": lambda v, raw: _choice(v, raw),
    "path": _path,
    "text": lambda v, raw: raw,
    "log_level": _log_level,
    "backend": _backend,
    "fault": _fault,
}


def _choice(v: Var, raw: str) -> str:
    s = raw.strip().lower()
    if s not in v.choices:
        shown = [c for c in v.choices if c] + (["unset"] if "" in v.choices else [])
        raise EnvError(f"{v.name}={raw!r}: expected one of {', '.join(shown)}")
    return s


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The typed value of the declared variable ``name`` in ``env`` (default: os.environ); its default when unset
    or empty. A bad value raises EnvError naming the variable."""
    v = VARS[name]
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw == "":
        return v.default
    return _PARSERS[v.kind](v, raw)


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` (declared) has a non-empty value: the cheap test of the hot paths (faults.point)."""
    assert name in VARS, name
    return bool((os.environ if env is None else env).get(name))


def raw(name: str, env: Mapping[str, str] | None = None) -> str:
    """The text of the declared variable ``name`` ("" when unset), for a module that parses it itself with errors of
    its own (faults.parse: S2T2_FAULT)."""
    assert name in VARS, name
    return (os.environ if env is None else env).get(name) or ""


def check(where: tuple[str, ...] = ("package",), env: Mapping[str, str] | None = None) -> None:
    """Every declared variable of ``where`` that is set must parse; the first bad one raises EnvError. Also
    refuses an ``S2T2_*`` name that is none of them and looks like a typo of one (``S2T2_TRACEBAK``)."""
    import difflib

    env = os.environ if env is None else env
    for v in VARS.values():
        if v.where in where:
            try:
                get(v.name, env)
            except EnvError:
                raise
            except Exception as e:  # noqa: BLE001 - a parser's own failure is still one line naming the variable
                raise EnvError(f"{v.name}={env.get(v.name)!r}: cannot be read ({type(e).__name__}: {e})") from None
    for k in sorted(env):
        if not k.startswith("S2T2_") or k in VARS or k in TEST_NAMES:
            continue
        if k in REMOVED:
            log.warning("%s is set but no longer read (%s); unset it", k, REMOVED[k])
            continue
        near = difflib.get_close_matches(k, list(VARS), n=1, cutoff=0.85)
        if near:
            raise EnvError(f"{k} is not a variable s2t2 reads (did you mean {near[0]}?); see docs/environment.md")
        log.warning("%s is not a variable s2t2 reads: it has no effect (the variables: docs/environment.md)", k)


def log_level() -> int | str:
    """S2T2_LOG_LEVEL for logging.basicConfig (names upper-cased: logging refuses 'debug')."""
    return get("S2T2_LOG_LEVEL")


def setup_logging() -> None:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s: %(message)s")


def traceback_wanted() -> bool:
    """S2T2_TRACEBACK; False when its own value is bad (that error is then said in one line, not raised again)."""
    try:
        return bool(get("S2T2_TRACEBACK"))
    except EnvError:
        return False


_TYPES = {"bool": "boolean", "int": "integer", "port": "port 1-65535", "choice": "one of", "path": "directory",
          "text": "text", "log_level": "log level", "backend": "backend", "fault": "fault spec"}


def markdown_table() -> str:
    """The table of docs/environment.md (tests/core/test_envvars.py compares the committed one with this)."""
    rows = ["| variable | read by | type | default | meaning |", "|---|---|---|---|---|"]
    for v in VARS.values():
        typ = _TYPES[v.kind] + (f" {', '.join(c or 'unset' for c in v.choices)}" if v.choices else "")
        if v.kind == "int" and v.minimum is not None:
            typ += f" >= {v.minimum}"
        default = "unset" if v.default in ("", 0) and v.kind in ("text", "path", "port", "backend", "fault",
                                                                   "choice", "int") else _doc_value(v.default)
        rows.append(f"| `{v.name}` | {'slurm/*.sh' if v.where == 'slurm' else 's2t2_dist'} | {typ} | {default} | "
                    f"{v.meaning} |")
    return "\n".join(rows) + "\n"


def _doc_value(value: Any) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def _shell(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """``check [package|slurm ...]``: exit 2 with one line on the first bad variable (default: both groups);
    ``get NAME``: print its value as the shell uses it (booleans 1/0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("check", "get") or (argv[0] == "get" and len(argv) != 2):
        print("usage: python -m s2t2_dist.envvars check [package|slurm ...] | get NAME", file=sys.stderr)
        return 2
    try:
        if argv[0] == "check":
            check(tuple(argv[1:]) or ("package", "slurm"))
        else:
            if argv[1] not in VARS:
                print(f"s2t2 env: error: {argv[1]} is not a declared variable", file=sys.stderr)
                return 2
            print(_shell(get(argv[1])))
    except EnvError as e:
        print(f"s2t2 env: error: EnvError: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
