"""Atomic, resumable checkpoints for multi-rank runs.

Layout: RUN/checkpoints/step_00000100/ holding each rank's engine files plus `loop_rankNNNNN.pt` (data position,
RNG) and, written last by rank 0, `meta.json`. Every rank writes into a `.partial` directory; once every rank has
written (and each node has flushed its writes to stable storage), rank 0 writes meta.json, listing every file with
its size, and renames the directory into place. A directory without meta.json, or still named .partial, is never
loaded, so a crash, a lost node or a full disk mid-write leaves the previous checkpoint the latest valid one.

Resuming (`resume`) takes the newest complete checkpoint whose files are all there with their recorded sizes; one
that is not (a file truncated or deleted after it was written) is renamed `step_N.corrupt`, said loudly, and the
previous one is used. A checkpoint of another configuration is refused, never skipped; one of another number of ranks too, unless the
Checkpointer is `elastic` (the engine then re-splits its shards on load).
Loading uses torch.load(weights_only=True): no code runs from a checkpoint.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from s2t2_dist import faults
from s2t2_dist.distributed import collectives as coll
from s2t2_dist.utils.io import atomic_write_text, fsync_dir
from s2t2_dist.errors import CheckpointError, CheckpointCorrupt

_STEP_RE = re.compile(r"^step_(\d{8})$")
log = logging.getLogger("s2t2.checkpoint")


_barrier = coll.barrier
_rank_world = coll.rank_world
_all_ok = coll.all_ranks


def _syncfs(path: Path) -> None:
    """Flush this node's dirty pages of the filesystem holding `path` (Linux syncfs; else sync)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) != 0:
                raise OSError(ctypes.get_errno(), "syncfs failed", str(path))
        finally:
            os.close(fd)
    except (AttributeError, OSError):
        os.sync()


def _local_rank() -> int:
    v = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0"
    return int(v) if v.isdigit() else 0


def _tree_sizes(directory: Path) -> dict[str, int]:
    out = {}
    for dirpath, _, files in os.walk(directory):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(directory))] = p.stat().st_size
    return out


def _space_hint(directory: Path, err: BaseException | None, previous: Path | None) -> str:
    """Why a write may have failed, in words: a full disk (ENOSPC/EDQUOT, or less free space than the previous
    checkpoint took: torch.save reports a full disk only as 'unexpected pos' or 'file write failed')."""
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        return ""
    need = sum(_tree_sizes(previous).values()) if previous is not None and previous.is_dir() else 0
    codes = set()
    e = err
    while e is not None:
        if isinstance(e, OSError) and e.errno is not None:
            codes.add(e.errno)
        e = e.__cause__ or e.__context__
    if codes & {errno.ENOSPC, errno.EDQUOT} or (need and free < need) or free < (1 << 20):
        return (f" -- the disk is full: {free:,} bytes free on the filesystem of {directory}"
                + (f", the previous checkpoint took {need:,}" if need else ""))
    return ""


def _said(err: BaseException | None, hint: str) -> str:
    """The error of a failed write, in the user's words: on a full disk torch.save's own text ('[enforce fail at
    inline_container.cc:...] . unexpected pos 576 vs 534') says nothing the hint does not say better."""
    if hint and not (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT) and err.strerror):
        return "the write failed"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return f"{type(err).__name__}: {err}"


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2, fingerprint: dict | None = None, elastic: bool = False):
        self.root = Path(run_dir) / "checkpoints"
        if keep < 1:  # 0 would delete every checkpoint as soon as it is written
            raise CheckpointError(f"train.keep_checkpoints must be >= 1, got {keep}")
        self.keep = keep
        # What must match for a checkpoint to be resumable (config hash, world size, shapes); checked at load.
        self.fingerprint = fingerprint or {}
        # elastic: a checkpoint of another number of ranks is accepted (the engine re-splits its shards and the
        # loop state -- the same on every rank: step counts, a global data position -- is read from rank 0's file)
        self.elastic = elastic

    def _loop_file(self, directory: Path, meta: dict) -> Path:
        rank, world = _rank_world()
        if meta.get("world_size") != world and self.elastic:
            return directory / "loop_rank00000.pt"
        return directory / f"loop_rank{rank:05d}.pt"

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for d in self.root.iterdir():
            m = _STEP_RE.match(d.name)
            if m and (d / "meta.json").is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        steps = self.complete_steps()
        return self.root / f"step_{steps[-1]:08d}" if steps else None

    def save(self, step: int, engine, loop_state: dict[str, Any]) -> Path:  # noqa: C901 - the atomic protocol's steps, each with its failure path
        rank, world = _rank_world()
        final = self.root / f"step_{step:08d}"
        partial = self.root / f"step_{step:08d}.partial"
        previous = self.latest()
        kept = f"; the previous checkpoint {previous.name if previous else '(none)'} is kept and still valid"
        err: BaseException | None = None
        if rank == 0:  # the run directory is still this run's: its lock and owner marker (utils/rundir.verify)
            from s2t2_dist.utils.rundir import verify

            try:
                verify(self.root.parent, before=f"writing checkpoint {final.name}")
            except BaseException as e:  # noqa: BLE001 - re-raised below on every rank
                err = e
        if not _all_ok(err is None):
            if err is not None:
                raise err
            raise CheckpointError(f"the run directory {self.root.parent} changed hands on rank 0; stopping")
        if rank == 0:
            try:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            except BaseException as e:  # noqa: BLE001 - re-raised below on every rank
                err = e
        if not _all_ok(err is None):
            hint = _space_hint(partial, err, previous)
            raise CheckpointError(f"creating checkpoint directory {partial} failed: {_said(err, hint)}{hint}{kept}") \
                from err
        try:
            faults.point("checkpoint.begin", step)
            engine.save(partial)
            faults.point("checkpoint.after_engine_save", step, path=str(partial))
            with open(partial / f"loop_rank{rank:05d}.pt", "wb") as f:
                torch.save(loop_state, f)
        except BaseException as e:  # noqa: BLE001 - re-raised below on every rank
            err = e
        if not _all_ok(err is None):
            hint = _space_hint(partial, err, previous)
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            if err is not None:
                raise CheckpointError(f"writing checkpoint {partial} failed on rank {rank}: "
                                      f"{_said(err, hint)}{hint}{kept}") from err
            raise CheckpointError(f"writing checkpoint {partial} failed on another rank{hint}{kept}")
        # Every file must be on stable storage before meta.json makes the checkpoint complete: a node that dies
        # (not just a process) after the rename must not leave a "complete" checkpoint with lost pages.
        if _local_rank() == 0:
            try:
                _syncfs(partial)
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank after the barrier
                err = e
        if not _all_ok(err is None):
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            hint = _space_hint(partial, err, previous)
            raise CheckpointError(f"flushing checkpoint {partial} to disk failed: {_said(err, hint)}{hint}{kept}") \
                from err
        if rank == 0:
            try:
                meta = {"step": step, "world_size": world, "fingerprint": self.fingerprint,
                        "files": _tree_sizes(partial)}
                atomic_write_text(partial / "meta.json", json.dumps(meta, indent=1))
                fsync_dir(partial)
                faults.point("checkpoint.before_rename", step)
                if final.exists():
                    shutil.rmtree(final)
                partial.rename(final)
                fsync_dir(self.root)
                faults.point("checkpoint.after_rename", step)
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank after the barrier
                err = e
                hint = _space_hint(partial, e, previous)
                shutil.rmtree(partial, ignore_errors=True)
                err = CheckpointError(f"{_said(e, hint)}{hint}")
        if not _all_ok(err is None):
            raise CheckpointError(f"finalising checkpoint {final} failed: {err or 'on rank 0'}{kept}")
        if rank == 0:
            self._prune()
        return final

    def _prune(self) -> None:
        """Drop all but the newest `keep` complete checkpoints, and leftovers of interrupted writes or prunes.
        meta.json goes first, so a prune cut short never leaves a half-deleted directory that looks complete."""
        try:
            steps = self.complete_steps()
            for s in steps[: max(len(steps) - self.keep, 0)]:
                d = self.root / f"step_{s:08d}"
                (d / "meta.json").unlink(missing_ok=True)
                fsync_dir(d)
                shutil.rmtree(d, ignore_errors=True)
            newest = steps[-1] if steps else -1
            for d in self.root.iterdir():
                m = _STEP_RE.match(d.name)
                if d.name.endswith(".partial") or (m and int(m.group(1)) < newest and not (d / "meta.json").exists()):
                    shutil.rmtree(d, ignore_errors=True)
        except OSError as e:  # the checkpoint itself is complete; leftovers are only disk space
            log.warning("pruning old checkpoints in %s failed: %s", self.root, e)

    def _read_meta(self, directory: Path) -> dict:
        try:
            return json.loads((directory / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointCorrupt(f"checkpoint {directory}: unreadable meta.json ({e})") from None

    def check_compatible(self, directory: Path, meta: dict | None = None) -> dict:  # noqa: C901 - one check per part
        """Refuse a checkpoint of another number of ranks or another configuration (CheckpointError)."""
        _, world = _rank_world()
        meta = self._read_meta(directory) if meta is None else meta
        if meta.get("world_size") != world and not self.elastic:
            raise CheckpointError(
                f"checkpoint {directory} was written by {meta.get('world_size')} ranks but this run has {world}; "
                "restart with the same number of ranks"
            )
        theirs = meta.get("fingerprint", {})
        unknown = [k for k in self.fingerprint if k not in theirs]
        if unknown:  # written before these were recorded: cannot be checked
            log.warning("checkpoint %s does not record %s; resuming without checking them", directory, unknown)
        diff = {k: (theirs.get(k), v) for k, v in self.fingerprint.items()
                if k in theirs and theirs.get(k) != v and not _same_as_hashed(theirs.get(k), v)}
        if diff:
            parts = []
            for k, (a, b) in diff.items():
                if isinstance(a, dict) and isinstance(b, dict):  # recorded as values: name each changed key
                    parts += [f"{k}.{n}: checkpoint={a.get(n)!r} run={b.get(n)!r}" for n in sorted(set(a) | set(b))
                              if a.get(n) != b.get(n)]
                else:
                    parts.append(f"{k}: checkpoint={a!r} run={b!r}")
            raise CheckpointError(f"checkpoint {directory} belongs to another configuration ({', '.join(parts)}); "
                                  "resume with the settings it was written with, or start a new run_dir")
        return meta

    def check_resumable(self) -> Path | None:
        """Before any work: the checkpoint `resume` would load must belong to this configuration (CheckpointError
        otherwise). Returns it, or None when there is none. Damaged ones are left for `resume` to set aside."""
        for step in reversed(self.complete_steps()):
            d = self.root / f"step_{step:08d}"
            try:
                self.check_compatible(d)
            except CheckpointCorrupt:
                continue
            return d
        return None

    def verify(self, directory: Path, meta: dict | None = None) -> dict:
        """Every file meta.json lists is there with its recorded size (CheckpointCorrupt names the first that is
        not). Checkpoints written before sizes were recorded pass."""
        meta = self._read_meta(directory) if meta is None else meta
        for rel, size in (meta.get("files") or {}).items():
            f = directory / rel
            try:
                got = f.stat().st_size
            except OSError:
                raise CheckpointCorrupt(f"checkpoint {directory}: {rel} is missing") from None
            if got != size:
                raise CheckpointCorrupt(f"checkpoint {directory}: {rel} has {got:,} bytes, {size:,} were written "
                                        "(truncated or overwritten)")
        return meta

    def load(self, directory: Path, engine) -> dict[str, Any]:
        rank, _ = _rank_world()
        meta = self.check_compatible(directory)
        self.verify(directory, meta)
        f = self._loop_file(directory, meta)
        if not f.is_file():
            raise CheckpointCorrupt(f"checkpoint {directory}: missing {f.name}")
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises several types for damaged files
            raise CheckpointCorrupt(f"checkpoint {directory}: {f.name} is unreadable ({type(e).__name__}: {e})") from e
        engine.load(directory)
        return state

    def resume(self, engine) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest complete, intact checkpoint into `engine` and return (its directory, the loop state), or
        None when there is none. A damaged one is set aside as step_N.corrupt (after every rank agreed) and the one
        before it is used; one of another configuration or rank count is refused (CheckpointError). Collective."""
        rank, _ = _rank_world()
        steps = self.complete_steps()
        damaged: list[str] = []
        for i in range(len(steps) - 1, -1, -1):
            d = self.root / f"step_{steps[i]:08d}"
            err: BaseException | None = None
            try:
                meta = self.check_compatible(d)
                self.verify(d, meta)
                lf = self._loop_file(d, meta)
                if not lf.is_file():
                    raise CheckpointCorrupt(f"checkpoint {d}: missing {lf.name}")
                state = torch.load(lf, map_location="cpu", weights_only=True)
            except CheckpointCorrupt as e:
                err = e
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - an unreadable loop state file
                err = CheckpointCorrupt(f"checkpoint {d}: loop_rank{rank:05d}.pt is unreadable "
                                        f"({type(e).__name__}: {e})")
            if _all_ok(err is None):
                if meta.get("world_size") != _rank_world()[1] and rank == 0:
                    log.warning("resuming %s, written by %s ranks, on %d ranks", d, meta.get("world_size"),
                                _rank_world()[1])
                engine.load(d)
                if damaged and rank == 0:  # said once more where it matters: the steps since are recomputed
                    log.warning("resuming from the older checkpoint %s (step %d), not the newest (%s damaged): "
                                "the steps after it are computed again", d.name, steps[i], ", ".join(damaged))
                return d, state
            if err is not None:
                log.error("rank %d: %s", rank, err)
            _barrier()  # every rank has looked at d before rank 0 moves it
            if rank == 0:
                bad = d.with_name(d.name + ".corrupt")
                n = 1
                while bad.exists():
                    bad, n = d.with_name(f"{d.name}.corrupt{n}"), n + 1
                d.rename(bad)
                fsync_dir(self.root)
                before = (f"trying the one before it, {self.root.name}/step_{steps[i - 1]:08d}" if i else
                          "no checkpoint is left: the run starts from step 0")
                log.error("checkpoint %s is damaged (%s); moved to %s; %s", d, err or "on another rank", bad.name,
                          before)
            damaged.append(d.name)
            _barrier()
        if damaged and rank == 0:
            log.warning("every checkpoint in %s was damaged (%s, set aside as *.corrupt): starting from step 0, "
                        "not resuming", self.root, ", ".join(damaged))
        return None


def _same_as_hashed(theirs, ours) -> bool:
    """A section recorded by value now and as a short hash by older checkpoints (stages/common.fingerprint: sha256 of
    its JSON, 16 hex digits): the same setting when the hash of ours is theirs."""
    if not (isinstance(theirs, str) and isinstance(ours, dict)):
        return False
    import hashlib
    import json

    return hashlib.sha256(json.dumps(ours, sort_keys=True, default=str).encode()).hexdigest()[:16] == theirs
