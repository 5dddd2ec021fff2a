"""Reading shards: `ShardReader` (samples by position, errors naming the shard) for the training loader
(global_loader.py), and `EvalDocs`, the eval documents of one rank."""

from __future__ import annotations

import bisect
import hashlib
import random
import tarfile
from pathlib import Path
from collections.abc import Iterator

import numpy as np
import torch

from s2t2_dist.errors import DataError, ManifestError, ShardError
from .shards import load_manifest, npy_load, sample_key


def seed_int(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def shuffled(n: int, *seed_parts) -> list[int]:
    """A seeded permutation of range(n), identical on every machine and Python >= 3.2."""
    order = list(range(n))
    random.Random(seed_int(*seed_parts)).shuffle(order)
    return order


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


def to_torch(b: dict, pin: bool) -> dict:
    out = {}
    for k, v in b.items():
        t = torch.from_numpy(v.astype(np.int64, copy=False))
        out[k] = t.pin_memory() if pin else t
    return out


def ignore_sigint(_worker_id: int) -> None:
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
