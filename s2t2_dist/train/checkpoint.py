"""Atomic, resumable checkpoints for multi-rank runs.

Layout: RUN/checkpoints/step_00000100/ holding each rank's engine files plus `loop_rankNNNNN.pt` (data position,
RNG) and, written last by rank 0, `meta.json`. Every rank writes into a `.partial` directory; after a barrier
rank 0 writes meta.json and renames the directory into place. A directory without meta.json, or still named
.partial, is never loaded, so a crash or a full disk mid-write leaves the previous checkpoint the latest valid one.
Loading uses torch.load(weights_only=True): no code runs from a checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from s2t2_dist.testing import faults
from s2t2_dist.utils.io import atomic_write_text, fsync_dir

_STEP_RE = re.compile(r"^step_(\d{8})$")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ok is True on every rank (so a failure on one rank is seen by all)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([0.0 if ok else 1.0])
        dist.all_reduce(t)
        return t.item() == 0.0
    return ok


class CheckpointError(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2, fingerprint: dict | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        # What must match for a checkpoint to be resumable (config hash, world size, shapes); checked at load.
        self.fingerprint = fingerprint or {}

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

    def save(self, step: int, engine, loop_state: dict[str, Any]) -> Path:
        rank, world = _rank_world()
        final = self.root / f"step_{step:08d}"
        partial = self.root / f"step_{step:08d}.partial"
        if rank == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        _barrier()
        err: BaseException | None = None
        try:
            faults.point("checkpoint.begin", step)
            engine.save(partial)
            faults.point("checkpoint.after_engine_save", step, path=str(partial))
            torch.save(loop_state, partial / f"loop_rank{rank:05d}.pt")
        except BaseException as e:  # noqa: BLE001 - re-raised below on every rank
            err = e
        if not _all_ok(err is None):
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            if err is not None:
                raise CheckpointError(f"writing checkpoint {partial} failed on rank {rank}: {err}") from err
            raise CheckpointError(f"writing checkpoint {partial} failed on another rank; previous checkpoint kept")
        if rank == 0:
            try:
                meta = {"step": step, "world_size": world, "fingerprint": self.fingerprint}
                atomic_write_text(partial / "meta.json", json.dumps(meta, indent=1))
                fsync_dir(partial)
                faults.point("checkpoint.before_rename", step)
                if final.exists():
                    shutil.rmtree(final)
                partial.rename(final)
                fsync_dir(self.root)
                faults.point("checkpoint.after_rename", step)
                self._prune()
            except BaseException as e:
                shutil.rmtree(partial, ignore_errors=True)
                err = e
        if not _all_ok(err is None):
            raise CheckpointError(f"finalising checkpoint {final} failed: {err}")
        return final

    def _prune(self) -> None:
        steps = self.complete_steps()
        for s in steps[: max(len(steps) - self.keep, 0)]:
            shutil.rmtree(self.root / f"step_{s:08d}", ignore_errors=True)
        for d in self.root.glob("step_*.partial"):
            shutil.rmtree(d, ignore_errors=True)

    def load(self, directory: Path, engine) -> dict[str, Any]:
        rank, world = _rank_world()
        meta_file = directory / "meta.json"
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {directory}: unreadable meta.json ({e})") from None
        if meta.get("world_size") != world:
            raise CheckpointError(
                f"checkpoint {directory} was written by {meta.get('world_size')} ranks but this run has {world}; "
                "restart with the same number of ranks"
            )
        theirs = meta.get("fingerprint", {})
        diff = {k: (theirs.get(k), v) for k, v in self.fingerprint.items() if theirs.get(k) != v}
        if diff:
            lines = ", ".join(f"{k}: checkpoint={a!r} run={b!r}" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {directory} belongs to another configuration ({lines})")
        engine.load(directory)
        f = directory / f"loop_rank{rank:05d}.pt"
        if not f.is_file():
            raise CheckpointError(f"checkpoint {directory}: missing {f.name}")
        return torch.load(f, map_location="cpu", weights_only=True)
