"""The global-position loader: the samples of each optimiser step do not depend on the number of ranks, and a
position saved by W ranks resumes on W' ranks with exactly the samples the uninterrupted run would use next."""

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from tests.helpers.data_files import MMSEQS, split_and_train
from tests.helpers.finetune_fixtures import sample_fasta

from s2t2_dist.errors import DataError
from s2t2_dist.data.global_loader import GlobalTrainLoader
from s2t2_dist.data.shards import write_shards

T, G = 32, 12
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("gloader")
    fasta = sample_fasta(MMSEQS, root / "sample.fasta", 40, max_len=200)  # about 250 blocks
    split_and_train(root, [fasta], vocab_size=128)
    write_shards(split_dir=root / "splits", split="train", tokenizer=root / "tok", output_dir=root / "train",
                 context_len=T, shard_size=37, num_workers=0, progress=False)
    return root / "train"


def _loaders(data, world, micro=2, **kw):
    return [GlobalTrainLoader(data, global_batch_size=G, micro_batch_size=micro, rank=r, world_size=world, seed=5,
                              shuffle_window=16, return_index=True, **kw) for r in range(world)]


def _steps(loaders, n_steps, state=None):
    """The sample indices of each of the next n_steps optimiser steps (ranks' micro-batches concatenated), the
    ids of the first sample of each step, and the state after them."""
    its = []
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(state)
        its.append(iter(ld))
    steps = []
    for _ in range(n_steps):
        idx = []
        for r, ld in enumerate(loaders):
            for _ in range(ld.accum):
                try:
                    b = next(its[r])
                except StopIteration:  # the epoch is over: the next iter() starts the next one (as the loop does)
                    its[r] = iter(ld)
                    b = next(its[r])
                idx += b["index"].tolist()
        steps.append(idx)
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)  # the position is global: every rank saves the same
    return steps, states[0]


def test_steps_do_not_depend_on_the_number_of_ranks_and_cover_the_epoch(data):
    n = json.loads((data / "manifest.json").read_text())["totals"]["n_samples"]
    per_epoch = n // G
    ref, _ = _steps(_loaders(data, 1, micro=3), per_epoch)
    for world, micro in ((2, 3), (3, 4), (6, 1)):
        got, _ = _steps(_loaders(data, world, micro=micro), per_epoch)
        assert got == ref, (world, micro)
    flat = [i for s in ref for i in s]
    assert len(flat) == len(set(flat)) == per_epoch * G  # each sample at most once per epoch
    assert _loaders(data, 1)[0].dropped_per_epoch == n - per_epoch * G < G
    # the next epoch has another order
    ld = _loaders(data, 2)
    nxt, _ = _steps(ld, per_epoch + 1)
    assert nxt[:per_epoch] == ref and nxt[per_epoch] != ref[0]


def test_resume_on_another_number_of_ranks_continues_exactly(data):
    n = json.loads((data / "manifest.json").read_text())["totals"]["n_samples"]
    total = n // G + 3  # across an epoch boundary
    ref, _ = _steps(_loaders(data, 2), total)
    a, st = _steps(_loaders(data, 2), 2)
    b, st = _steps(_loaders(data, 3), n // G - 2, st)  # ends exactly at the epoch's end
    assert st["epoch"] == 1 and st["samples"] == 0
    c, _ = _steps(_loaders(data, 1, micro=4), 2, st)
    d, _ = _steps(_loaders(data, 6, micro=1, num_workers=2), 2, st)
    assert a + b + c == ref[:len(a + b + c)]
    # workers (steps dealt round-robin) give the same batches
    assert c == d


def test_layout_mismatch_mid_epoch_is_refused(data):
    _, st = _steps(_loaders(data, 2), 1)
    other = GlobalTrainLoader(data, global_batch_size=6, micro_batch_size=2, world_size=1, seed=5, shuffle_window=16)
    with pytest.raises(DataError, match="global_batch_size: saved 12, now 6"):
        other.load_state_dict(st)
    with pytest.raises(DataError, match="not a multiple of micro_batch_size x ranks = 4 x 2"):
        GlobalTrainLoader(data, global_batch_size=G, micro_batch_size=4, rank=0, world_size=2)
    with pytest.raises(DataError, match="per rank"):
        _loaders(data, 1)[0].load_state_dict({**st, "layout": None})


def test_batches_hold_the_shard_blocks(data):
    ld = _loaders(data, 1)[0]
    b = next(iter(ld))
    assert b["input_ids"].shape == (2, T) and b["input_ids"].dtype == torch.int64
    assert np.all(b["input_ids"].numpy() >= 0)


def _children() -> list[int]:
    me, kids = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                kids.append(int(d))
    return kids


def test_workers_survive_ctrl_c(data):
    """Ctrl-C reaches every process of the terminal's group; the loader's workers must keep serving batches so the
    training loop can write its checkpoint at the next step boundary (the SIGINT path of the stages)."""
    loader = _loaders(data, 1, num_workers=1, multiprocessing_context="fork")[0]
    it = iter(loader)
    next(it)
    kids = _children()
    assert kids, "no worker process"
    for pid in kids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    for _ in range(5):
        assert next(it)["input_ids"].numel()
