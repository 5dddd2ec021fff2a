"""One collective and one host read for every value a logging step reduces over the ranks.

Components register named per-rank partial values into a :class:`StatsBatch` (the loop its loss sums, token count
and stop flag; the translator the partial sums, maxima and shards of its P statistics and its gradient monitor);
:meth:`StatsBatch.reduce` then packs them into ONE float64 buffer on their device, reduces it with ONE
``all_reduce(SUM)`` and copies it to the host ONCE (the only device -> host read of a logging step). Every op is
encoded as a sum:

* ``sum``: summed over ranks (exact for integers below 2**53);
* ``max`` / ``min``: each rank writes its value into its own row of a ``world x n`` zero block, so the sum IS the
  all-gather; the host takes the max / min over the rows (exact; costs ``world x n``: meant for small values);
* ``rows``: a shard of a global tensor (rank r's rows ``[offset, offset + n)`` of ``total`` rows, disjoint over
  ranks, e.g. C's columns); the sum is the concatenation (uneven shards need no padding);
* ``local``: this rank's own value, not reduced (kept out of the reduced part of the buffer), read with the rest.

Results are numpy arrays in the registered dtype (a float32 value is reduced in float64 and rounded back once), so
whoever finishes the statistics works on host values without torch ops (a torch op on a host copy is no device
sync, but the dispatch-mode sync counter of utils/syncs.py cannot tell it from one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from s2t2_dist.distributed import collectives as coll

__all__ = ["StatsBatch", "Reduced", "OPS"]

OPS = ("sum", "max", "min", "rows", "local")

_NP = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
       torch.int32: np.int32, torch.bool: np.bool_}


class Reduced:
    """The reduced values by name: numpy arrays (0-d for scalars) in their registered dtype and shape."""

    def __init__(self, values: dict[str, np.ndarray]):
        self._v = values

    def __getitem__(self, name: str) -> np.ndarray:
        return self._v[name]

    def __contains__(self, name: str) -> bool:
        return name in self._v

    def float(self, name: str) -> float:
        return float(self._v[name])


class StatsBatch:
    """Collects named partial values (see the module docstring) and reduces them in one collective.

    ``device``: where the buffer is built (the values' device; a host float is copied there); ``group``: the ranks
    to reduce over (default: every rank, on the group serving ``device``: NCCL for CUDA, gloo for CPU). One use:
    register, :meth:`reduce` once."""

    def __init__(self, device: torch.device | str | None = None, group: Any = None):
        self.device = torch.device(device if device is not None else "cpu")
        self.group = group
        if coll.initialized():
            self.rank = dist.get_rank(group) if group is not None else coll.rank()
            self.world = dist.get_world_size(group) if group is not None else coll.world_size()
        else:
            self.rank, self.world = 0, 1
        self._reduced: list[torch.Tensor] = []  # flat float64 pieces of the summed part
        self._local: list[torch.Tensor] = []  # flat float64 pieces read without reduction
        # name -> (op, part, offset, shape, dtype, rows offset/total)
        self._slots: dict[str, tuple] = {}
        self._sizes = [0, 0]
        self._done = False

    # ---------------------------------------------------------------------------------------------------------
    def add(self, name: str, value, op: str = "sum") -> None:
        """Register ``value`` (a tensor or a Python number) under ``name`` with ``op`` in sum / max / min / local."""
        if op == "rows":
            raise ValueError("rows: use add_rows(name, value, offset, total)")
        self._add(name, value, op, None)

    def add_rows(self, name: str, value, offset: int, total: int) -> None:
        """Register this rank's rows ``[offset, offset + len(value))`` of a ``total``-row tensor; the result is the
        whole tensor (rows no rank wrote are zero)."""
        t = self._tensor(value)
        if t.dim() == 0 or not 0 <= offset <= offset + t.shape[0] <= total:
            raise ValueError(f"add_rows {name!r}: rows [{offset}, {offset + (t.shape[0] if t.dim() else 0)}) "
                             f"do not fit in {total}")
        self._add(name, t, "rows", (offset, total))

    def _tensor(self, value) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.detach()
        return torch.tensor(value, dtype=torch.float64)

    def _add(self, name: str, value, op: str, rows) -> None:
        if self._done:
            raise RuntimeError("StatsBatch: already reduced")
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if name in self._slots:
            raise ValueError(f"StatsBatch: {name!r} registered twice")
        t = self._tensor(value)
        dtype, shape = t.dtype, tuple(t.shape)
        if dtype not in _NP:
            raise TypeError(f"StatsBatch: {name!r} has dtype {dtype}, not one of {sorted(map(str, _NP))}")
        # float64 holds every registered dtype exactly (integers below 2**53)
        flat = t.to(device=self.device, dtype=torch.float64, non_blocking=True).reshape(-1)
        if op in ("max", "min") and self.world > 1:  # own row of a world x n block: the sum gathers them
            block = torch.zeros(self.world, flat.numel(), dtype=torch.float64, device=self.device)
            block[self.rank] = flat
            flat = block.reshape(-1)
        elif op == "rows":
            offset, total = rows
            per_row = flat.numel() // shape[0] if shape[0] else int(np.prod(shape[1:], dtype=np.int64))
            full = torch.zeros(total * per_row, dtype=torch.float64, device=self.device)
            full[offset * per_row: offset * per_row + flat.numel()] = flat
            flat = full
            shape = (total,) + shape[1:]
        part = 1 if op == "local" else 0
        (self._local if part else self._reduced).append(flat)
        self._slots[name] = (op, part, self._sizes[part], shape, dtype, flat.numel())
        self._sizes[part] += flat.numel()

    # ---------------------------------------------------------------------------------------------------------
    def reduce(self) -> Reduced:
        """The one all_reduce(SUM) (none on one rank) and the one device -> host copy; returns the values."""
        if self._done:
            raise RuntimeError("StatsBatch: already reduced")
        self._done = True
        pieces = self._reduced + self._local
        if not pieces:
            return Reduced({})
        buf = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
        n_red = self._sizes[0]
        if self.world > 1 and n_red:
            group = self.group if self.group is not None else coll.group_for(self.device)
            dist.all_reduce(buf[:n_red], group=group)  # a leading slice of a 1-D tensor: contiguous, in place
        host = buf.cpu().numpy()  # the one read
        out = {}
        for name, (op, part, off, shape, dtype, n) in self._slots.items():
            x = host[(0 if part == 0 else n_red) + off:][:n]
            if op in ("max", "min") and self.world > 1:
                x = x.reshape(self.world, -1)
                x = x.max(0) if op == "max" else x.min(0)
            out[name] = x.reshape(shape).astype(_NP[dtype])
        return Reduced(out)
