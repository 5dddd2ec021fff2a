"""The host-sync counter (s2t2_dist.utils.syncs) counts exactly the ops that read device values back."""
import torch

from s2t2_dist.utils.syncs import count_host_syncs


def _count(fn):
    with count_host_syncs() as c:
        fn()
    return c


def test_counts_every_listed_read_back():
    x = torch.randn(10)
    m = x > 0
    syncing = {
        "item": lambda: x.sum().item(), "int": lambda: int(x[0] > 0), "bool": lambda: bool(m.any()),
        "nonzero": lambda: m.nonzero(), "where(cond)": lambda: torch.where(m), "x[mask]": lambda: x[m],
        "x[mask]=": lambda: x.clone().__setitem__(m, 0.0), "masked_select": lambda: x.masked_select(m),
        "unique": lambda: torch.unique(m), "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "bincount": lambda: torch.bincount(torch.tensor([1, 2])), "allclose": lambda: torch.allclose(x, x),
    }
    for name, fn in syncing.items():
        assert _count(fn).total == 1, name


def test_ignores_sync_free_ops_and_sees_backward():
    x = torch.randn(10, requires_grad=True)
    m = x.detach() > 0
    free = [lambda: torch.where(m, x, 0), lambda: x[torch.tensor([1, 2])], lambda: x.topk(3), lambda: x.sort(),
            lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3), lambda: m.sum()]
    for fn in free:
        assert _count(fn).total == 0
    with count_host_syncs(record_stacks=True) as c:
        x[m].sum().backward()  # forward: index with a mask; backward: index_put with the same mask
    assert dict(c.counts) == {"index[bool mask]": 1, "index_put[bool mask]": 1}, c.summary()
    assert len(c.stacks) == 2 and "test_utils_syncs" in c.stacks[0][1]
