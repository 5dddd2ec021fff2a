"""Division by a plan's marginals (pure math): the normalised weights ``W = P / nu`` of a transport plan, where a
zero marginal has an all-zero row or column of ``P``."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["safe_inv"]


def safe_inv(x: Tensor) -> Tensor:
    """1/x where x > 0, 0 elsewhere (a zero marginal: its all-zero row/column of P gets weights 0, not NaN)."""
    return torch.where(x > 0, 1.0 / x.clamp(min=torch.finfo(x.dtype).tiny), torch.zeros_like(x))
