"""Count the operations that force a device -> host read (a GPU stall), on any device, CPU included.

    from s2t2_dist.utils.syncs import count_host_syncs
    with count_host_syncs() as c:
        loss = step()
    assert c.total == 0, c.summary()

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op below autograd (the backward pass
included), so the count does not depend on the device: a CPU run finds the syncs a CUDA run would stall on.
Counted (the op needs a value or a data-dependent size on the host):

* ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``if t:``), ``is_nonzero``, ``equal``,
  ``allclose``;
* ``nonzero`` (also ``torch.where(cond)`` with one argument, ``argwhere``), ``masked_select``, ``unique`` (all forms),
  ``bincount``, ``histc`` (CUDA reads its min/max), ``repeat_interleave`` without ``output_size``;
* advanced indexing with a bool mask: ``x[mask]`` (``index``), ``x[mask] = v`` (``index_put``);
* a copy from a non-CPU tensor to a CPU one (never on a CPU run).

Collectives are not ops here (gloo on CPU tensors reads nothing back): they are not counted.
"""
from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_host_syncs"]

_aten = torch.ops.aten
# ops that always read back (a scalar, or an output size that depends on the values)
_ALWAYS = {
    _aten._local_scalar_dense, _aten.is_nonzero, _aten.equal, _aten.allclose, _aten.nonzero, _aten.masked_select,
    _aten.unique_dim, _aten._unique, _aten._unique2, _aten.unique_consecutive, _aten.unique_dim_consecutive,
    _aten.bincount, _aten.histc,
}


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _sync_reason(func, args, kwargs) -> str | None:
    """The op's name when calling ``func(*args, **kwargs)`` needs a device -> host read, else None."""
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return packet.__name__
    if packet is _aten.repeat_interleave:
        if isinstance(args[0], torch.Tensor) and args[0].dim() >= 0 and func in (
                _aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor):
            if kwargs.get("output_size") is None and not (len(args) > 3 and args[3] is not None):
                return "repeat_interleave"
        return None
    if packet in (_aten.index, _aten._unsafe_index):
        return "index[bool mask]" if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")) else None
    if packet in (_aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        return ("index_put[bool mask]" if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
                else None)
    if packet in (_aten._to_copy, _aten.copy_, _aten._copy_from, _aten._copy_from_and_resize):
        src = args[1] if packet is _aten.copy_ else args[0]
        if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
            return None
        if packet is _aten.copy_:
            dst_dev = args[0].device
        elif packet is _aten._to_copy:
            dst_dev = kwargs.get("device") or src.device
        else:
            dst_dev = args[1].device if len(args) > 1 and isinstance(args[1], torch.Tensor) else src.device
        return "copy to host" if torch.device(dst_dev).type == "cpu" else None
    return None


class SyncCounter(TorchDispatchMode):
    """Counts host-synchronising ops while active (see the module docstring). ``counts``: op name -> calls.

    ``record_stacks=True`` keeps the Python stack of each counted call in ``stacks`` (to find where they come from).
    """

    def __init__(self, record_stacks: bool = False):
        super().__init__()
        self.counts: Counter = Counter()
        #: every aten op dispatched while active (a CPU proxy for a GPU's kernel launches: each op is at most one)
        self.ops = 0
        self.record_stacks = record_stacks
        self.stacks: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self.counts[reason] += 1
            if self.record_stacks:
                self.stacks.append((reason, "".join(traceback.format_stack(limit=12)[:-1])))
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.ops = 0
        self.counts.clear()
        self.stacks.clear()

    def summary(self) -> str:
        """One line: the total and the count per op."""
        return f"{self.total} host syncs: " + (", ".join(f"{k} x{v}" for k, v in sorted(self.counts.items()))
                                               or "none")


@contextmanager
def count_host_syncs(record_stacks: bool = False) -> Iterator[SyncCounter]:
    """``with count_host_syncs() as c: ...`` then ``c.total`` / ``c.counts`` / ``c.summary()``."""
    counter = SyncCounter(record_stacks)
    with counter:
        yield counter
