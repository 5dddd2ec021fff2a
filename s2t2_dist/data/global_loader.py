"""The training loader whose data position is one global count, so that a run can resume on another number of ranks.

Epoch layout, a function of (seed, epoch, shuffle_window, global batch) only -- never of the number of ranks:

1. the shards are put in a seeded random order for the epoch, their samples concatenated (positions 0..N-1), and
   the positions shuffled in windows of ``shuffle_window`` (seeded per window, so the order at any position can be
   recomputed without reading what came before);
2. optimiser step t of the epoch takes the G = ``global_batch_size`` samples at positions [t*G, (t+1)*G); rank r of
   W takes the contiguous slice [r*G/W, (r+1)*G/W) of it and cuts it into micro-batches of ``micro_batch_size``;
3. the last N mod G samples of an epoch (fewer than one global batch) are not used in that epoch
   (``dropped_per_epoch``; the next epoch's order differs, so other samples fall off).

The position saved in a checkpoint is (epoch, samples of the epoch consumed), as OLMo-core keeps a global token count:
any number of ranks that divides the global batch continues with exactly the samples the uninterrupted run would
have used next, none repeated, none skipped. Every rank reads the shards in full (the tar bytes; it decodes only its
own samples): translate's data are small next to its model. With ``num_workers`` > 0 the batches are made by
DataLoader workers (steps dealt round-robin) and come back in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from s2t2_dist.errors import DataError, ManifestError, ShardError
from .reader import ShardReader, ignore_sigint, shuffled, to_torch
from .shards import load_manifest


class _GlobalStream:
    """Picklable; ``stream(w, nw, epoch, step0)`` yields the micro-batches of this rank for the steps t >= step0 of
    the epoch with t % nw == w, each tagged with its rank-level micro-batch number."""

    def __init__(self, manifest: dict, *, rank, world_size, global_batch_size, micro_batch_size, seed,
                 shuffle_window, return_index):
        self.m = manifest
        self.rank, self.world, self.G, self.B = rank, world_size, global_batch_size, micro_batch_size
        self.seed, self.S, self.return_index = seed, shuffle_window, return_index
        self.per_rank = self.G // self.world
        self.accum = self.per_rank // self.B
        self.N = int(sum(s["n_samples"] for s in manifest["shards"]))

    @property
    def steps_per_epoch(self) -> int:
        return self.N // self.G

    def stream(self, w: int, nw: int, epoch: int, step0: int) -> Iterator[dict]:
        reader = ShardReader(self.m)
        order = shuffled(len(self.m["shards"]), "shards", self.seed, epoch)
        cur, window, perm = -1, None, None
        src, src_pos = None, 0  # one sequential read from the first window needed on (windows only go forward)
        for t in range(step0, self.steps_per_epoch):
            if t % nw != w:
                continue
            lo = t * self.G + self.rank * self.per_rank
            ids, idx = [], []
            for p in range(lo, lo + self.per_rank):
                win = p // self.S
                if win != cur:
                    a, b = win * self.S, min((win + 1) * self.S, self.N)
                    if src is None:
                        src, src_pos = reader.iter_range(order, a, self.N), a
                    for _ in itertools.islice(src, a - src_pos):  # windows this rank has no sample in
                        pass
                    window = list(itertools.islice(src, b - a))
                    src_pos = b
                    if len(window) != b - a:
                        raise ShardError(f"{self.m['_dir']}: the shards hold fewer samples than the manifest says")
                    perm = shuffled(b - a, "global_window", self.seed, epoch, win)
                    cur = win
                index, sample = window[perm[p - win * self.S]]
                ids.append(reader.decode_ids(index, sample, sample.get("__url__", "?")))
                idx.append(index)
            for a in range(self.accum):
                sl = slice(a * self.B, (a + 1) * self.B)
                out = {"input_ids": np.stack(ids[sl]), "_batch": t * self.accum + a}
                if self.return_index:
                    out["index"] = np.asarray(idx[sl], dtype=np.int64)
                yield out


def _identity(x):  # the DataLoader's collate_fn: the workers make whole batches (a module-level function pickles)
    return x


class _WorkerDataset(torch.utils.data.IterableDataset):
    def __init__(self, stream: _GlobalStream, nw: int, epoch: int, step0: int):
        self.stream, self.nw, self.epoch, self.step0 = stream, nw, epoch, step0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w = 0 if info is None else info.id
        # the DataLoader asks workers 0, 1, ... in turn; worker w starts with step step0 + w
        return self.stream.stream((self.step0 + w) % self.nw, self.nw, self.epoch, self.step0)


class GlobalTrainLoader:
    """Micro-batches ``{"input_ids": LongTensor[micro_batch_size, context_len]}`` of one rank; resumable on any
    number of ranks dividing ``global_batch_size / micro_batch_size`` (see the module doc)."""

    def __init__(self, shards, *, global_batch_size: int, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, seed: int = 0, shuffle_window: int = 4096, return_index: bool = False,
                 check_files: bool = True, prefetch_factor: int = 4, multiprocessing_context: str | None = None,
                 pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batch_size < 1 or shuffle_window < 1 or num_workers < 0:
            raise DataError("micro_batch_size and shuffle_window must be >= 1, num_workers >= 0")
        if global_batch_size % (micro_batch_size * world_size):
            raise DataError(f"the global batch of {global_batch_size} is not a multiple of micro_batch_size x ranks "
                            f"= {micro_batch_size} x {world_size}")
        self.manifest = load_manifest(shards, check_files=check_files)
        if self.manifest["kind"] != "packed":
            raise ManifestError(f"{self.manifest['_dir']}: the loader needs a train (packed) split, this is "
                                f"{self.manifest['split']!r} ({self.manifest['kind']})")
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.seed, self.shuffle_window = seed, shuffle_window
        self.prefetch_factor, self.mp_context = prefetch_factor, multiprocessing_context
        #: page-locked batches (set it when training on CUDA): a .to(device, non_blocking=True) copy of a pageable
        #: tensor blocks the host until it is done
        self.pin_memory = pin_memory
        self._stream = _GlobalStream(self.manifest, rank=rank, world_size=world_size,
                                     global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                     seed=seed, shuffle_window=shuffle_window, return_index=return_index)
        if self._stream.steps_per_epoch == 0:
            raise DataError(f"{self.manifest['_dir']} holds {self._stream.N} blocks, fewer than one global batch "
                            f"({global_batch_size})")
        self.epoch = 0
        self.batch = 0  # micro-batches of this rank of the current epoch already yielded

    @property
    def accum(self) -> int:
        return self._stream.accum

    def __len__(self) -> int:
        """Micro-batches of this rank per epoch."""
        return self._stream.steps_per_epoch * self.accum

    @property
    def dropped_per_epoch(self) -> int:
        return self._stream.N - self._stream.steps_per_epoch * self.global_batch_size

    # -- state ----------------------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"global_batch_size": self.global_batch_size, "seed": self.seed, "shuffle_window": self.shuffle_window}

    def state_dict(self) -> dict:
        if self.batch % self.accum:
            raise DataError(f"loader state asked for in the middle of an optimiser step (micro-batch {self.batch}, "
                            f"{self.accum} per step); this is a bug")
        epoch, samples = self.epoch, self.batch // self.accum * self.global_batch_size
        if self.batch and self.batch >= len(self):
            epoch, samples = epoch + 1, 0
        return {"layout": "global", "epoch": epoch, "samples": samples, "manifest": self.manifest.get("job_hash"),
                **self._layout()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("manifest") != self.manifest.get("job_hash"):
            raise ManifestError(f"loader state was saved for other shards (manifest {state.get('manifest')}), "
                                f"not {self.manifest['_dir']} ({self.manifest.get('job_hash')})")
        if state.get("layout") != "global":
            raise DataError("the checkpoint's data position is per rank (an older checkpoint); resume it with the "
                            "version and number of ranks that wrote it")
        diff = {k: (state.get(k), v) for k, v in self._layout().items() if state.get(k) != v}
        if diff and state["samples"] != 0:
            raise DataError("cannot resume mid-epoch with a different data layout "
                            f"({', '.join(f'{k}: saved {a}, now {b}' for k, (a, b) in diff.items())}); "
                            "use the saved values, or resume from a checkpoint taken at an epoch boundary")
        samples = int(state["samples"])
        if samples % self.global_batch_size:
            raise DataError(f"saved position {samples} is not a whole number of global batches of "
                            f"{self.global_batch_size}")
        self.epoch, self.batch = int(state["epoch"]), samples // self.global_batch_size * self.accum

    # -- iteration --------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        if self.batch >= len(self):
            self.epoch, self.batch = self.epoch + 1, 0
        epoch, step0 = self.epoch, self.batch // self.accum
        if self.batch % self.accum:
            raise DataError(f"cannot start iterating in the middle of an optimiser step (micro-batch {self.batch})")
        if self.num_workers == 0:
            source = self._stream.stream(0, 1, epoch, step0)
        else:
            nw = min(self.num_workers, max(self._stream.steps_per_epoch - step0, 1))
            source = iter(torch.utils.data.DataLoader(
                _WorkerDataset(self._stream, nw, epoch, step0), batch_size=None, collate_fn=_identity,
                num_workers=nw, prefetch_factor=self.prefetch_factor, multiprocessing_context=self.mp_context,
                persistent_workers=False, worker_init_fn=ignore_sigint))
        pending: dict[int, dict] = {}
        try:
            for b in source:
                pending[b.pop("_batch")] = b
                while self.batch in pending:
                    out = to_torch(pending.pop(self.batch), self.pin_memory)
                    self.batch += 1
                    yield out
        finally:
            shutdown = getattr(source, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if self.batch != len(self) or pending:
            raise DataError(f"loader produced {self.batch} of {len(self)} micro-batches of epoch {epoch} "
                            f"(unmatched: {sorted(pending)}); this is a bug")
        self.epoch, self.batch = epoch + 1, 0
