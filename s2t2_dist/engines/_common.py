"""Small collective helpers shared by the engines."""

from __future__ import annotations

import torch
import torch.distributed as dist


def raise_if_any_failed(err: BaseException | None, what: str) -> None:
    """Re-raise `err` on its rank and a matching error on every other rank (so no rank waits forever)."""
    bad = torch.tensor([0.0 if err is None else 1.0])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad)
    if bad.item():
        if err is not None:
            raise RuntimeError(f"{what} failed: {err}") from err
        raise RuntimeError(f"{what} failed on another rank")
