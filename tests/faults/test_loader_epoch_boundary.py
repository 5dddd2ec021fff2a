"""Regression: saving the loader's state (a checkpoint) right after the last batch of an epoch, while the loop's
iterator is still suspended there, used to corrupt the iterator (`loader produced 0 of N batches ... this is a
bug` on the next step). Every run whose checkpoint interval divided the epoch length died at the epoch boundary."""

import pytest

from s2t2_dist.data.global_loader import GlobalTrainLoader

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_at_epoch_end_keeps_the_live_iterator(tiny_data, num_workers):
    kw = dict(global_batch_size=4, micro_batch_size=2, rank=1, world_size=2, num_workers=num_workers, seed=0,
              shuffle_window=16, return_index=True)
    L = GlobalTrainLoader(tiny_data / "shards/new/train", **kw)
    n = len(L)
    seen, states = [], []
    it = iter(L)
    for _ in range(n + 3):  # what the loop does: next(), and iter() again at StopIteration
        try:
            b = next(it)
        except StopIteration:
            it = iter(L)
            b = next(it)
        seen.append(b["index"].tolist())
        states.append(L.state_dict())  # a checkpoint after every step
    assert states[n - 1]["epoch"] == 1 and states[n - 1]["samples"] == 0
    assert states[n]["epoch"] == 1 and states[n]["samples"] == 4
    epoch0 = [i for b in seen[:n] for i in b]
    assert len(epoch0) == len(set(epoch0)) == 40  # rank 1's half of the 80 blocks, each once
    # resuming from the state saved at the epoch's end continues exactly like the live iterator
    R = GlobalTrainLoader(tiny_data / "shards/new/train", **kw)
    R.load_state_dict(states[n - 1])
    assert [b["index"].tolist() for b, _ in zip(R, range(3))] == seen[n:]
