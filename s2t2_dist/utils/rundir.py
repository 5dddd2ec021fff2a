"""One run per directory: the lock every stage holds on its output directory, and the marker naming the run that
owns it.

- The lock is `fcntl.flock` on RUN_DIR/.s2t2.lock, taken by the job's rank 0 only (one holder per job: the other
  ranks of the same job are not refused by it) and held until the process exits; the OS drops it when the process
  dies, so a crashed or requeued job never blocks the next one. The file names the holder (host, pid, start time,
  stage, SLURM job) for the refusal of a second run. On a shared filesystem this is exactly as good as the
  filesystem's flock: coherent across nodes on Lustre mounted with `flock`, GPFS and NFSv4; node-local with
  Lustre `localflock` or NFS `local_lock=all`, where two jobs whose rank 0 run on different nodes are not seen.
- The marker RUN_DIR/.s2t2_run.json records the stage and a run id at the directory's first use; a directory of
  another stage (or one that holds another stage's outputs from before markers existed) is refused.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path

from s2t2_dist.errors import RunDirError

LOCK = ".s2t2.lock"
MARKER = ".s2t2_run.json"
#: files that tell which stage wrote a directory that has no marker (written before markers existed)
_SIGNS = {"prepare_summary.json": "prepare", "P.safetensors": "translate", "eval.json": "evaluate",
          "final": "finetune", "export_probe.pt": "finetune"}

_held: dict[str, int] = {}  # resolved directory -> open fd of its lock (kept open: the lock lives with the process)
_run_ids: dict[str, str] = {}  # resolved directory -> the run id of the marker this process claimed it under
_for_life: set[str] = set()  # locks release_all keeps (lock(..., until_exit=True))


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return (f"s2t2 {h.get('stage')} on host {h.get('host')}, pid {h.get('pid')}, started {h.get('start')}"
                + (f", SLURM job {h['slurm_job']}" if h.get("slurm_job") else ""))
    except (OSError, ValueError, AttributeError):
        return "another process (holder not recorded yet)"


def lock(directory: str | Path, stage: str, key: str = "run_dir", until_exit: bool = False) -> Path:
    """Take the run lock of `directory` (created if needed) or raise RunDirError naming the holder. Idempotent
    within a process. `until_exit`: held until the process exits (a command that runs stages in-process, which
    drop their own locks when they end: :func:`release_all`)."""
    d = Path(directory)
    real = str(d.resolve())
    if real in _held:
        return d
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        raise RunDirError(f"{key}: cannot write into {d} (permission denied)") from None
    except IsADirectoryError:
        raise RunDirError(f"{key}: {d / LOCK} is a directory; the run lock is a file there (remove it)") from None
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(f"{key}: {d} exists and is not a directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"{key}: {d} is in use by another run ({_holder(d / LOCK)}); wait for it to end, or "
                          "choose another directory") from None
    info = {"stage": stage, "host": socket.gethostname(), "pid": os.getpid(),
            "start": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "slurm_job": os.environ.get("SLURM_JOB_ID")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[real] = fd
    if until_exit:
        _for_life.add(real)
    return d


def release(directory: str | Path) -> None:
    """Drop the lock early (tests, recipes that run several stages in one process); exiting drops it too."""
    _run_ids.pop(str(Path(directory).resolve()), None)
    fd = _held.pop(str(Path(directory).resolve()), None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Drop every lock this process holds: a stage run in-process (tests, recipes) leaves its directory free."""
    for d in [d for d in _held if d not in _for_life]:
        os.close(_held.pop(d))
    for d in [d for d in _run_ids if d not in _for_life]:
        del _run_ids[d]


def owner(directory: str | Path) -> dict | None:
    """The marker of `directory` ({"stage", "run_id", "created"}), or None."""
    try:
        m = json.loads((Path(directory) / MARKER).read_text())
        return m if isinstance(m, dict) else None
    except (OSError, ValueError):
        return None


def _guess_stage(d: Path) -> str | None:
    for name, stage in _SIGNS.items():
        if (d / name).exists():
            return stage
    return None


def check_owner(directory: str | Path, stage: str, key: str = "run_dir") -> None:
    """Refuse a directory owned by a run of another stage, and one written through a symbolic link that leads out
    of it. Reads only (every rank may call it)."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise RunDirError(f"{key}: {d} exists and is not a directory")
    if not d.is_dir():
        return
    m = owner(d)
    theirs = m.get("stage") if m else _guess_stage(d)
    if theirs is not None and theirs != stage:
        what = f"run {m.get('run_id')} of {m.get('created')}" if m else "files from before run markers"
        a = "an" if stage[0] in "aeiou" else "a"
        raise RunDirError(f"{key}: {d} belongs to a {theirs} run ({what}); {a} {stage} run would overwrite its "
                          f"files; choose another {key}")
    root = d.resolve()
    for p in d.iterdir():
        if p.is_symlink() and root not in (p.resolve().parents if p.exists() else ()) and p.name != LOCK:
            raise RunDirError(f"{key}: {p} is a symbolic link to {os.readlink(p)}, out of the run directory; "
                              "a run writes only inside its own directory (remove the link)")


def claim(directory: str | Path, stage: str, key: str = "run_dir") -> dict:
    """Rank 0, before the first unit of work: check the owner, take the lock, write the marker on first use.
    Returns the marker."""
    check_owner(directory, stage, key)
    d = lock(directory, stage, key)
    m = owner(d)
    if m is None:
        m = {"stage": stage, "run_id": uuid.uuid4().hex[:12],
             "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        from s2t2_dist.utils.io import atomic_write_json

        atomic_write_json(d / MARKER, m)
    _run_ids[str(d.resolve())] = str(m.get("run_id"))
    return m


def verify(directory: str | Path, key: str = "run_dir", before: str = "writing on") -> None:
    """Rank 0 of a run, before it writes again (each checkpoint): the lock file it holds is still the one at
    RUN_DIR/.s2t2.lock and the marker still names its run. Someone deleting the lock file lets a second run lock a
    new one; a removed or replaced run directory would be re-created and written into. RunDirError if either
    changed; a no-op for a directory this process did not claim."""
    d = Path(directory)
    real = str(d.resolve())
    fd = _held.get(real)
    if fd is None:
        return
    held = os.fstat(fd)
    what = None
    if not d.is_dir():
        what = "was removed"
    else:
        try:
            st = os.stat(d / LOCK)
            if (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
                what = f"has a new lock file ({_holder(d / LOCK)}): its lock file was deleted or replaced"
        except FileNotFoundError:
            what = "lost its lock file (deleted)"
        if what is None and real in _run_ids:
            m = owner(d)
            if m is None:  # a marker that exists but does not parse is not "deleted": say which
                what = (f"lost its owner marker {MARKER} (deleted)" if not (d / MARKER).exists() else
                        f"has an owner marker {MARKER} that is not a run's JSON any more (overwritten)")
            elif str(m.get("run_id")) != _run_ids[real]:
                what = (f"is now owned by another run ({MARKER}: {m.get('stage')} run {m.get('run_id')}, not this "
                        f"run {_run_ids[real]})")
    if what is not None:
        raise RunDirError(f"{key}: {d} {what} while this run was using it; stopping instead of {before} (another "
                          "run may be writing there); check the directory, then run again")


def run_id(directory: str | Path) -> str | None:
    m = owner(directory)
    return m.get("run_id") if m else None
