"""Step 4: exact epoch coverage over ranks x workers, seeded shuffling, mid-epoch resume, errors naming shards."""

import json
import random
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch
from data_files import MMSEQS, split_and_train

from s2t2_dist.data.errors import DataError, ManifestError, ShardError
from s2t2_dist.data.loader import EvalDocs, TrainLoader, batches_done_by_worker, epoch_plan
from s2t2_dist.data.shards import npy_load, write_shards

T = 64
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    split_and_train(root, [MMSEQS], vocab_size=256, max_records=200)
    for split in ("train", "eval"):
        # 97 samples per shard: the shard count divides neither ranks nor workers
        write_shards(split_dir=root / "splits", split=split, tokenizer=root / "tok", output_dir=root / split,
                     context_len=T, shard_size=97 if split == "train" else 13, num_workers=0, progress=False)
    return root


def n_train(root):
    return json.loads((root / "train" / "manifest.json").read_text())["totals"]["n_samples"]


def blocks_by_index(root):
    out = {}
    for s in json.loads((root / "train" / "manifest.json").read_text())["shards"]:
        with tarfile.open(root / "train" / s["name"]) as tf:
            for m in tf:
                out[int(m.name.split(".")[0])] = npy_load(tf.extractfile(m).read())
    return out


def epoch_indices(loader):
    return [b["index"].tolist() for b in loader]


@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_plan_covers_every_position_once(drop_last):
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.randint(1, 30) for _ in range(rng.randint(1, 9))]
        W, nw, B = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 6)
        n = sum(sizes)
        covered, dropped = [], 0
        for r in range(W):
            p = epoch_plan(sizes, epoch=3, seed=1, rank=r, world_size=W, n_workers=nw, batch_size=B,
                           drop_last=drop_last)
            assert sum(w.n_batches for w in p.workers) == p.n_batches
            assert p.rank_hi - p.rank_lo in (n // W, n // W + 1)
            for w in p.workers:
                covered.extend(range(w.seg_lo, w.seg_hi))
                # a worker's segment holds exactly its batches (only the rank's last batch may be short)
                assert w.seg_hi - w.seg_lo <= w.n_batches * B
            dropped += p.dropped
            assert p.dropped < B if drop_last else p.dropped == 0
        assert len(covered) == len(set(covered)) == n - dropped
    assert batches_done_by_worker(7, 0, 3) == 3 and batches_done_by_worker(7, 1, 3) == 2
    assert batches_done_by_worker(0, 2, 3) == 0


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_every_block_exactly_once_per_epoch(data, world_size, num_workers):
    N = n_train(data)
    seen = Counter()
    per_rank = []
    for r in range(world_size):
        L = TrainLoader(data / "train", batch_size=8, rank=r, world_size=world_size, num_workers=num_workers,
                        seed=3, shuffle_window=50, return_index=True)
        batches = list(L)
        assert len(batches) == len(L)
        assert all(b["input_ids"].shape == (8, T) and b["input_ids"].dtype == torch.long for b in batches[:-1])
        assert 1 <= batches[-1]["input_ids"].shape[0] <= 8
        per_rank.append(sum(b["input_ids"].shape[0] for b in batches))
        for b in batches:
            seen.update(b["index"].tolist())
        assert L.state_dict()["epoch"] == 1 and L.state_dict()["batch"] == 0
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    assert max(per_rank) - min(per_rank) <= 1


def test_batches_hold_the_blocks_they_claim(data):
    ref = blocks_by_index(data)
    L = TrainLoader(data / "train", batch_size=8, num_workers=2, seed=0, return_index=True)
    for i, b in enumerate(L):
        for idx, row in zip(b["index"].tolist(), b["input_ids"]):
            assert np.array_equal(row.numpy(), ref[idx].astype(np.int64))
        if i == 20:
            break


def test_shuffle_is_seeded_and_changes_each_epoch(data):
    a = TrainLoader(data / "train", batch_size=8, seed=5, shuffle_window=200, return_index=True)
    b = TrainLoader(data / "train", batch_size=8, seed=5, shuffle_window=200, return_index=True)
    c = TrainLoader(data / "train", batch_size=8, seed=6, shuffle_window=200, return_index=True)
    e0 = epoch_indices(a)
    assert e0 == epoch_indices(b)
    assert e0 != epoch_indices(c)
    flat = [i for bt in e0 for i in bt]
    assert flat != sorted(flat)
    e1 = epoch_indices(a)  # the next iter() is epoch 1
    assert e1 != e0 and sorted(i for bt in e1 for i in bt) == sorted(flat)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_rest(data, num_workers):
    kw = dict(batch_size=8, rank=1, world_size=2, num_workers=num_workers, seed=9, shuffle_window=40,
              return_index=True)
    full = epoch_indices(TrainLoader(data / "train", **kw))
    K = len(full)
    for k in (0, 1, 5, K - 1, K):
        first = TrainLoader(data / "train", **kw)
        got = []
        if k:
            for i, b in enumerate(first):
                got.append(b["index"].tolist())
                if i + 1 == k:
                    break
        state = first.state_dict()
        assert state["batch"] == k % K and state["epoch"] == (1 if k == K else 0)
        second = TrainLoader(data / "train", **kw)
        second.load_state_dict(state)
        rest = epoch_indices(second) if k < K else []
        assert got + rest == full, f"resume at batch {k}"
    # a state saved at the end of an epoch resumes into the next epoch, which again covers everything once
    seen = Counter()
    for r in (0, 1):
        nxt = TrainLoader(data / "train", **{**kw, "rank": r})
        nxt.load_state_dict({**nxt.state_dict(), "epoch": 1})
        seen.update(i for b in epoch_indices(nxt) for i in b)
    assert sorted(seen) == list(range(n_train(data))) and set(seen.values()) == {1}


def test_state_from_other_data_or_layout_is_refused(data):
    L = TrainLoader(data / "train", batch_size=8, num_workers=0)
    it = iter(L)
    next(it)
    st = L.state_dict()
    other = TrainLoader(data / "train", batch_size=8, world_size=2, rank=0)
    with pytest.raises(DataError, match="world_size: saved 1, now 2"):
        other.load_state_dict(st)
    other.load_state_dict({**st, "batch": 0})  # at an epoch boundary any layout may resume
    with pytest.raises(ManifestError, match="other shards"):
        L.load_state_dict({**st, "manifest": "0" * 64})


def test_corrupt_shard_is_named(data, tmp_path):
    import shutil

    shutil.copytree(data / "train", tmp_path / "train")
    m = json.loads((tmp_path / "train" / "manifest.json").read_text())
    name = m["shards"][0]["name"]
    p = tmp_path / "train" / name
    raw = bytearray(p.read_bytes())
    raw[512 * 2 + 3 * 1536: 512 * 2 + 3 * 1536 + 200] = bytes(range(200))  # smash a tar header mid-shard
    p.write_bytes(bytes(raw))
    for nw in (0, 2):
        L = TrainLoader(tmp_path / "train", batch_size=8, num_workers=nw, world_size=1)
        with pytest.raises(ShardError, match=name):
            list(L)
    p.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(ShardError, match=rf"{name} has \d+ bytes"):
        TrainLoader(tmp_path / "train", batch_size=8)
    # a shard swapped for another one of the same size does not match its manifest
    other = tmp_path / "train" / m["shards"][1]["name"]
    p.write_bytes(other.read_bytes())
    with pytest.raises(ShardError, match=rf"{name}: sample #0 has key"):
        list(TrainLoader(tmp_path / "train", batch_size=8, shuffle_window=10_000))


def test_wrong_split_and_too_few_blocks(data):
    with pytest.raises(ManifestError, match="needs a train"):
        TrainLoader(data / "eval", batch_size=8)
    with pytest.raises(ManifestError, match="needs an eval"):
        EvalDocs(data / "train")
    L = TrainLoader(data / "train", batch_size=n_train(data), world_size=2, rank=1, drop_last=True)
    with pytest.raises(DataError, match="gets no batch"):
        next(iter(L))
    with pytest.raises(DataError, match="rank 2"):
        TrainLoader(data / "train", batch_size=8, rank=2, world_size=2)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_docs_split_exactly_across_ranks(data, world_size):
    m = json.loads((data / "eval" / "manifest.json").read_text())
    seen, nbytes, ntok = Counter(), 0, 0
    for r in range(world_size):
        E = EvalDocs(data / "eval", rank=r, world_size=world_size)
        docs = list(E)
        assert len(docs) == len(E)
        for d in docs:
            seen[d["index"]] += 1
            nbytes += d["n_bytes"]
            ntok += len(d["input_ids"]) - 1
            assert d["input_ids"][0].item() == 0 and d["input_ids"].dtype == torch.long
    assert sorted(seen) == list(range(m["totals"]["n_docs"])) and set(seen.values()) == {1}
    assert nbytes == m["totals"]["text_bytes"] and ntok == m["totals"]["n_tokens"]
