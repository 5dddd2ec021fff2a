"""Step 4, the one training loader (GlobalTrainLoader) on shards whose count divides neither ranks nor workers:
epoch coverage over ranks x workers, the blocks it claims, seeded shuffling, mid-epoch resume, errors naming shards;
and EvalDocs."""

import json
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch
from tests.helpers.data_files import MMSEQS, split_and_train

from s2t2_dist.errors import DataError, ManifestError, ShardError
from s2t2_dist.data.global_loader import GlobalTrainLoader
from s2t2_dist.data.reader import EvalDocs
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


def loader(root, *, world_size=1, rank=0, micro=4, global_batch=12, **kw):
    return GlobalTrainLoader(root / "train", global_batch_size=global_batch, micro_batch_size=micro, rank=rank,
                             world_size=world_size, return_index=True, **kw)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_every_block_at_most_once_per_epoch(data, world_size, num_workers):
    N = n_train(data)
    seen = Counter()
    for r in range(world_size):
        L = loader(data, world_size=world_size, rank=r, micro=12 // world_size, num_workers=num_workers, seed=3,
                   shuffle_window=50)
        batches = list(L)
        assert len(batches) == len(L) == N // 12
        assert all(b["input_ids"].shape == (12 // world_size, T) and b["input_ids"].dtype == torch.long
                   for b in batches)
        for b in batches:
            seen.update(b["index"].tolist())
        assert L.state_dict()["epoch"] == 1 and L.state_dict()["samples"] == 0
    # only the last N mod 12 positions of the epoch (fewer than one global batch) are left out
    assert len(seen) == N - N % 12 and set(seen.values()) == {1} and set(seen) <= set(range(N))
    assert L.dropped_per_epoch == N % 12


def test_batches_hold_the_blocks_they_claim(data):
    ref = blocks_by_index(data)
    L = loader(data, num_workers=2, seed=0)
    for i, b in enumerate(L):
        for idx, row in zip(b["index"].tolist(), b["input_ids"]):
            assert np.array_equal(row.numpy(), ref[idx].astype(np.int64))
        if i == 20:
            break


def test_shuffle_is_seeded_and_changes_each_epoch(data):
    a, b = loader(data, seed=5, shuffle_window=200), loader(data, seed=5, shuffle_window=200)
    c = loader(data, seed=6, shuffle_window=200)
    e0 = epoch_indices(a)
    assert e0 == epoch_indices(b)
    assert e0 != epoch_indices(c)
    flat = [i for bt in e0 for i in bt]
    assert flat != sorted(flat)
    e1 = epoch_indices(a)  # the next iter() is epoch 1
    assert e1 != e0 and len(set(i for bt in e1 for i in bt)) == len(flat)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_rest(data, num_workers):
    kw = dict(rank=1, world_size=2, micro=6, num_workers=num_workers, seed=9, shuffle_window=40)
    full = epoch_indices(loader(data, **kw))
    K = len(full)
    for k in (0, 1, 5, K - 1, K):
        first = loader(data, **kw)
        got = []
        if k:
            for i, b in enumerate(first):
                got.append(b["index"].tolist())
                if i + 1 == k:
                    break
        state = first.state_dict()
        assert state["samples"] == (k % K) * 12 and state["epoch"] == (1 if k == K else 0)
        second = loader(data, **kw)
        second.load_state_dict(state)
        rest = epoch_indices(second) if k < K else []
        assert got + rest == full, f"resume at batch {k}"
    # a state saved at the end of an epoch resumes into the next epoch, which again holds each block at most once
    seen = Counter()
    for r in (0, 1):
        nxt = loader(data, **{**kw, "rank": r})
        nxt.load_state_dict({**nxt.state_dict(), "epoch": 1})
        seen.update(i for b in epoch_indices(nxt) for i in b)
    assert len(seen) == K * 12 and set(seen.values()) == {1}


def test_state_from_other_data_is_refused(data):
    L = loader(data, micro=12)
    it = iter(L)
    next(it)
    st = L.state_dict()
    other = loader(data, global_batch=24, micro=12)
    with pytest.raises(DataError, match="global_batch_size: saved 12, now 24"):
        other.load_state_dict(st)
    other.load_state_dict({**st, "samples": 0})  # at an epoch boundary any layout may resume
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
        with pytest.raises(ShardError, match=name):
            list(loader(tmp_path, num_workers=nw))
    p.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(ShardError, match=rf"{name} has \d+ bytes"):
        loader(tmp_path)
    # a shard swapped for another one of the same size does not match its manifest
    other = tmp_path / "train" / m["shards"][1]["name"]
    p.write_bytes(other.read_bytes())
    with pytest.raises(ShardError, match=rf"{name}: sample #0 has key"):
        list(loader(tmp_path, shuffle_window=10_000))


def test_wrong_split_and_too_few_blocks(data):
    with pytest.raises(ManifestError, match="needs a train"):
        GlobalTrainLoader(data / "eval", global_batch_size=8, micro_batch_size=8)
    with pytest.raises(ManifestError, match="needs an eval"):
        EvalDocs(data / "train")
    with pytest.raises(DataError, match="fewer than one global batch"):
        loader(data, global_batch=2 * n_train(data), micro=n_train(data), world_size=2, rank=1)
    with pytest.raises(DataError, match="rank 2"):
        loader(data, rank=2, world_size=2, micro=6)


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
