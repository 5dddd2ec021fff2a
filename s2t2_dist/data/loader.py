"""Step 4: the training loader (packed blocks -> batches) and the eval document iterator.

Epoch layout, computed from the manifest alone (no I/O), so every rank and worker agrees without talking:

1. the shards are put in a seeded random order for the epoch (``seed``, ``epoch``); the samples of the epoch are
   numbered 0..N-1 along that order;
2. rank r takes the contiguous range [r*N//W, (r+1)*N//W) (sizes differ by at most one; nothing is dropped);
3. the rank's K = ceil(n_r / B) batches are dealt to its dataloader workers round-robin (batch j -> worker j % nw,
   the order in which torch's DataLoader collects them), and each worker reads one contiguous segment holding
   exactly its batches, so no shard is read by two workers of a rank except where a segment boundary cuts it;
4. a worker shuffles its segment in windows of ``shuffle_window`` samples (a seeded buffer that is emptied at window
   boundaries, so the order can be recomputed from a position) and cuts batches in order.

Every block of the split is in exactly one batch of exactly one rank per epoch; only the last batch of a rank may be
short (``drop_last=True`` drops those at most B-1 samples instead, and ``dropped_per_epoch`` says how many).
The position is (epoch, batches consumed): ``state_dict()`` / ``load_state_dict()`` restore it, and the resumed
run yields exactly the batches the uninterrupted run would have yielded next, in the same order. Each worker skips
to its position by reading at most one window plus one shard's worth of samples. When an epoch is over, iteration
stops; the next ``iter(loader)`` starts the next epoch (ranks may differ by one batch per epoch).

Reading uses webdataset's tar iterators; errors name the shard.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .errors import DataError, ManifestError, ShardError
from .shards import load_manifest, npy_load, sample_key


def _seed_int(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def _shuffled(n: int, *seed_parts) -> list[int]:
    """A seeded permutation of range(n), identical on every machine and Python >= 3.2."""
    order = list(range(n))
    random.Random(_seed_int(*seed_parts)).shuffle(order)
    return order


# ---------------------------------------------------------------------------------------------------------------
# shard reading


class ShardReader:
    """Reads samples by position from a manifest's shards, in a given shard order."""

    def __init__(self, manifest: dict):
        self.m = manifest
        self.dir = Path(manifest["_dir"])
        self.shards = manifest["shards"]
        self.kind = manifest["kind"]
        self.T = manifest["context_len"]

    def iter_range(self, order: list[int], p0: int, p1: int) -> Iterator[tuple[int, dict]]:
        """(global sample index, raw sample dict) for positions [p0, p1) of the concatenation of shards in
        ``order``. Positions are counted along ``order``; the returned index is the sample's own (manifest) one."""
        if p0 >= p1:
            return
        sizes = [self.shards[i]["n_samples"] for i in order]
        starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        k = bisect.bisect_right(starts, p0) - 1
        pos = p0
        while pos < p1 and k < len(order):
            s = self.shards[order[k]]
            lo = pos - starts[k]
            hi = min(p1 - starts[k], s["n_samples"])
            for local, sample in self._read_shard(s, lo, hi):
                yield s["first_index"] + local, sample
            pos = starts[k] + hi
            k += 1

    def _read_shard(self, s: dict, lo: int, hi: int) -> Iterator[tuple[int, dict]]:
        import webdataset as wds

        path = self.dir / s["name"]
        i = -1
        try:
            f = open(path, "rb")
        except OSError as e:
            raise ShardError(f"shard {path} cannot be opened ({e}); it is listed in {self.dir / 'manifest.json'}") from None
        try:
            files = wds.tariterators.tar_file_expander([{"url": str(path), "stream": f}])
            for i, sample in enumerate(wds.tariterators.group_by_keys(files)):
                want = sample_key(s["first_index"] + i)
                if sample["__key__"] != want:
                    raise ShardError(f"shard {path}: sample #{i} has key {sample['__key__']!r}, expected {want!r}; "
                                     "the shard does not match its manifest")
                if i >= hi:
                    return
                if i >= lo:
                    yield i, sample
        except ShardError:
            raise
        except (tarfile.TarError, EOFError, OSError, ValueError, KeyError, UnicodeDecodeError) as e:
            raise ShardError(f"shard {path} is corrupt or truncated (after sample #{i}): "
                             f"{type(e).__name__}: {e}") from None
        finally:
            f.close()
        if i + 1 != s["n_samples"]:
            raise ShardError(f"shard {path} holds {i + 1} samples but the manifest says {s['n_samples']}: "
                             "truncated or replaced")

    def decode_ids(self, index: int, sample: dict, path_hint: str) -> np.ndarray:
        try:
            arr = npy_load(sample["input_ids.npy"])
        except KeyError:
            raise ShardError(f"shard {path_hint}: sample {index} has no input_ids.npy member") from None
        except (ValueError, OSError, EOFError) as e:
            raise ShardError(f"shard {path_hint}: sample {index} has a corrupt input_ids.npy ({e})") from None
        if arr.ndim != 1 or (self.kind == "packed" and arr.shape[0] != self.T):
            raise ShardError(f"shard {path_hint}: sample {index} has shape {arr.shape}, expected ({self.T},)"
                             if self.kind == "packed" else
                             f"shard {path_hint}: sample {index} has shape {arr.shape}, expected 1-D")
        return arr


# ---------------------------------------------------------------------------------------------------------------
# epoch plan


@dataclass(frozen=True)
class WorkerPlan:
    worker: int
    seg_lo: int  # epoch positions [seg_lo, seg_hi)
    seg_hi: int
    n_batches: int


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    shard_order: list
    rank_lo: int
    rank_hi: int
    n_batches: int
    last_batch_size: int
    dropped: int
    workers: tuple


def epoch_plan(shard_sizes: list[int], *, epoch: int, seed: int, rank: int, world_size: int, n_workers: int,
               batch_size: int, drop_last: bool = False) -> EpochPlan:
    """Which positions each worker of ``rank`` reads in ``epoch`` (see module doc). Pure function."""
    order = _shuffled(len(shard_sizes), "shards", seed, epoch)
    n = int(sum(shard_sizes))
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    n_r = hi - lo
    B = batch_size
    K = n_r // B if drop_last else -(-n_r // B)
    last = B if (drop_last or n_r % B == 0) else n_r % B
    if K == 0:
        last = 0
    dropped = n_r - K * B if drop_last else 0
    workers = []
    p = lo
    for w in range(n_workers):
        kw = len(range(w, K, n_workers))
        size = kw * B
        if K and (K - 1) % n_workers == w:
            size -= B - last
        workers.append(WorkerPlan(w, p, p + size, kw))
        p += size
    assert p == hi - dropped, (p, hi, dropped)
    return EpochPlan(epoch, order, lo, hi, K, last, dropped, tuple(workers))


def batches_done_by_worker(k: int, w: int, n_workers: int) -> int:
    """How many of the first k batches (j < k) belong to worker w (batch j -> worker j % n_workers)."""
    return max(0, (k - w + n_workers - 1) // n_workers)


# ---------------------------------------------------------------------------------------------------------------
# the iterable dataset run inside each dataloader worker


class _TrainStream:
    """Picklable; ``stream(worker, epoch, k)`` yields tagged batches of one logical worker from batch k of the rank."""

    def __init__(self, manifest: dict, *, rank, world_size, n_workers, batch_size, seed, shuffle_window, drop_last,
                 return_index):
        self.m = manifest
        self.rank, self.world, self.nw, self.B = rank, world_size, n_workers, batch_size
        self.seed, self.S, self.drop_last, self.return_index = seed, shuffle_window, drop_last, return_index

    def plan(self, epoch: int) -> EpochPlan:
        return epoch_plan([s["n_samples"] for s in self.m["shards"]], epoch=epoch, seed=self.seed, rank=self.rank,
                          world_size=self.world, n_workers=self.nw, batch_size=self.B, drop_last=self.drop_last)

    def stream(self, w: int, epoch: int, k: int) -> Iterator[dict]:
        plan = self.plan(epoch)
        wp = plan.workers[w]
        done = batches_done_by_worker(k, w, self.nw)
        skip = done * self.B
        seg_len = wp.seg_hi - wp.seg_lo
        if skip >= seg_len:
            return
        reader = ShardReader(self.m)
        S = self.S
        win0 = skip // S
        src = reader.iter_range(plan.shard_order, wp.seg_lo + win0 * S, wp.seg_hi)
        j = w + self.nw * done  # rank-level index of the next batch
        ids_buf: list[np.ndarray] = []
        idx_buf: list[int] = []
        first = True
        for win in range(win0, -(-seg_len // S)):
            n = min(S, seg_len - win * S)
            window = list(itertools.islice(src, n))
            if len(window) != n:
                raise ShardError(f"{self.m['_dir']}: the shards hold fewer samples than the manifest says")
            perm = _shuffled(n, "window", self.seed, epoch, self.rank, self.world, self.nw, w, win)
            if first:
                perm = perm[skip - win * S:]
                first = False
            for q in perm:
                index, sample = window[q]
                ids_buf.append(reader.decode_ids(index, sample, sample.get("__url__", "?")))
                idx_buf.append(index)
                if len(ids_buf) == self.B:
                    yield self._batch(ids_buf, idx_buf, j)
                    j += self.nw
                    ids_buf, idx_buf = [], []
        if ids_buf:
            yield self._batch(ids_buf, idx_buf, j)

    def _batch(self, ids, idx, j) -> dict:
        # compact numpy (uint16 for vocabularies <= 65536) crosses the worker pipe pickled, which is several times
        # faster than sharing int64 tensors; the main process widens it (`_to_torch`)
        out = {"input_ids": np.stack(ids), "_batch": j}
        if self.return_index:
            out["index"] = np.asarray(idx, dtype=np.int64)
        return out


def _identity(x):
    return x


def _to_torch(b: dict, pin: bool) -> dict:
    out = {}
    for k, v in b.items():
        t = torch.from_numpy(v.astype(np.int64, copy=False))
        out[k] = t.pin_memory() if pin else t
    return out


class _WorkerDataset(torch.utils.data.IterableDataset):
    """What each DataLoader worker runs: the DataLoader asks physical workers 0, 1, 2, ... in turn, so physical
    worker p plays logical worker (p + k) % nw, whose next batch is batch k + p of the rank."""

    def __init__(self, stream: _TrainStream, epoch: int, k: int):
        self.stream, self.epoch, self.k = stream, epoch, k

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        phys = 0 if info is None else info.id
        return self.stream.stream((phys + self.k) % self.stream.nw, self.epoch, self.k)


# ---------------------------------------------------------------------------------------------------------------
# public loaders


class TrainLoader:
    """Batches ``{"input_ids": LongTensor[B, context_len]}`` of one rank, resumable mid-epoch.

    ``shards``: a train shard directory (holding manifest.json) or the manifest path. ``num_workers``: torch
    DataLoader worker processes (0: read in this process). See the module doc for the exact epoch layout.
    """

    def __init__(self, shards, *, batch_size: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 seed: int = 0, shuffle_window: int = 4096, drop_last: bool = False, pin_memory: bool = False,
                 prefetch_factor: int = 4, return_index: bool = False, check_files: bool = True,
                 multiprocessing_context: str | None = None):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or shuffle_window < 1 or num_workers < 0:
            raise DataError("batch_size and shuffle_window must be >= 1, num_workers >= 0")
        self.manifest = load_manifest(shards, check_files=check_files)
        if self.manifest["kind"] != "packed":
            raise ManifestError(f"{self.manifest['_dir']}: the loader needs a train (packed) split, this is "
                                f"{self.manifest['split']!r} ({self.manifest['kind']})")
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.n_logical = max(1, num_workers)
        self.batch_size, self.seed, self.shuffle_window, self.drop_last = batch_size, seed, shuffle_window, drop_last
        self.pin_memory, self.prefetch_factor, self.mp_context = pin_memory, prefetch_factor, multiprocessing_context
        self._stream = _TrainStream(self.manifest, rank=rank, world_size=world_size, n_workers=self.n_logical,
                                    batch_size=batch_size, seed=seed, shuffle_window=shuffle_window,
                                    drop_last=drop_last, return_index=return_index)
        self.epoch = 0
        self.batch = 0  # batches of the current epoch already yielded

    # -- info ---------------------------------------------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> EpochPlan:
        return self._stream.plan(self.epoch if epoch is None else epoch)

    def __len__(self) -> int:
        """Batches of this rank per epoch."""
        return self.plan().n_batches

    @property
    def dropped_per_epoch(self) -> int:
        return self.plan().dropped

    # -- state ----------------------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.n_logical,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle_window": self.shuffle_window,
                "drop_last": self.drop_last}

    def state_dict(self) -> dict:
        epoch, batch = self.epoch, self.batch
        if batch and batch >= self.plan().n_batches:  # the epoch's last batch was consumed: resume in the next
            epoch, batch = epoch + 1, 0
        # (self is not changed: an iterator suspended after the epoch's last batch still counts on self.batch)
        return {"epoch": epoch, "batch": batch, "manifest": self.manifest.get("job_hash"), **self._layout()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("manifest") != self.manifest.get("job_hash"):
            raise ManifestError(f"loader state was saved for other shards (manifest {state.get('manifest')}), "
                                f"not {self.manifest['_dir']} ({self.manifest.get('job_hash')})")
        diff = {k: (state.get(k), v) for k, v in self._layout().items() if state.get(k) != v}
        if diff and state["batch"] != 0:
            raise DataError("cannot resume mid-epoch with a different data layout "
                            f"({', '.join(f'{k}: saved {a}, now {b}' for k, (a, b) in diff.items())}); "
                            "use the saved values, or resume from a checkpoint taken at an epoch boundary")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    # -- iteration --------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        plan = self.plan()
        if plan.n_batches == 0:
            raise DataError(f"rank {self.rank} gets no batch: the train split has {plan.rank_hi - plan.rank_lo} "
                            f"blocks for this rank and batch_size={self.batch_size}"
                            + (" with drop_last" if self.drop_last else ""))
        if self.batch >= plan.n_batches:  # a resumed state at the very end of an epoch
            self.epoch, self.batch = self.epoch + 1, 0
            plan = self.plan()
        epoch, k0 = self.epoch, self.batch
        if self.num_workers == 0:
            source = self._stream.stream(k0 % 1, epoch, k0)
        else:
            source = iter(torch.utils.data.DataLoader(
                _WorkerDataset(self._stream, epoch, k0), batch_size=None, collate_fn=_identity,
                num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                multiprocessing_context=self.mp_context, persistent_workers=False,
                worker_init_fn=_ignore_sigint))
        pending: dict[int, dict] = {}
        try:
            for b in source:
                pending[b.pop("_batch")] = b
                while self.batch in pending:
                    out = _to_torch(pending.pop(self.batch), self.pin_memory and torch.cuda.is_available())
                    self.batch += 1
                    yield out
        finally:
            # stop the workers now (also on an error or an abandoned iteration), not whenever the garbage
            # collector reaches the iterator: after a worker error that can take seconds per worker
            shutdown = getattr(source, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if self.batch != plan.n_batches or pending:
            raise DataError(f"loader produced {self.batch} of {plan.n_batches} batches of epoch {epoch} "
                            f"(unmatched: {sorted(pending)}); this is a bug")
        self.epoch, self.batch = epoch + 1, 0


def _ignore_sigint(_worker_id: int) -> None:
    """Ctrl-C reaches every process of the terminal's group: the workers keep serving while the training loop
    writes its checkpoint at the next step boundary (the main process stops them)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class EvalDocs:
    """Eval documents ``{"input_ids": LongTensor[n+1], "n_bytes": int, "n_chars": int, "id": str, "index": int}``
    of one rank: documents [r*N//W, (r+1)*N//W) in order, so each document is on exactly one rank."""

    def __init__(self, shards, *, rank: int = 0, world_size: int = 1, check_files: bool = True):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        self.manifest = load_manifest(shards, check_files=check_files)
        if self.manifest["kind"] != "docs":
            raise ManifestError(f"{self.manifest['_dir']}: EvalDocs needs an eval (docs) split, this is "
                                f"{self.manifest['split']!r} ({self.manifest['kind']})")
        n = self.manifest["totals"]["n_samples"]
        self.lo, self.hi = rank * n // world_size, (rank + 1) * n // world_size

    def __len__(self) -> int:
        return self.hi - self.lo

    def __iter__(self) -> Iterator[dict]:
        import json

        reader = ShardReader(self.manifest)
        order = list(range(len(self.manifest["shards"])))
        for index, sample in reader.iter_range(order, self.lo, self.hi):
            arr = reader.decode_ids(index, sample, sample.get("__url__", "?"))
            try:
                meta = json.loads(sample["json"])
                n_bytes, n_chars, rid = int(meta["n_bytes"]), int(meta["n_chars"]), meta["id"]
            except (KeyError, ValueError, TypeError) as e:
                raise ShardError(f"shard {sample.get('__url__', '?')}: sample {index} has no valid json member "
                                 f"({type(e).__name__}: {e})") from None
            yield {"input_ids": torch.from_numpy(arr.astype(np.int64)), "n_bytes": n_bytes, "n_chars": n_chars,
                   "id": rid, "index": index}
