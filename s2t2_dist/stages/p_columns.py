"""P's non-zeros with and without the target columns that no source piece builds.

With a large byte-level source vocabulary a few target tokens have no source pieces at all (`<pad>`, `<unk>`, a
byte that no source token starts with): the FVT start gives them a uniform column over every source row, so one
such column holds v non-zeros where a built column holds a handful, and P's overall density says little about
the rest (SmolLM2, v = 49,152: 23 such columns make the FVT start's density 4.5% where the built columns hold about
one non-zero each). result.json reports both (`P.start`, `P.end`: `unbuilt_columns`, `density_built`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unbuilt_columns(pieces: Sequence[Sequence[int]]) -> list[int]:
    """Target ids whose surface decomposition (`ot.prior.decompose(...).pieces`) has no source piece."""
    return [j for j, p in enumerate(pieces) if not p]


def column_split(col_nnz: torch.Tensor, v: int, unbuilt: Sequence[int]) -> dict:
    """Non-zeros per target column (u) of a v x u P -> density and mean non-zeros per column over the columns some
    source piece builds, and the mean over the unbuilt ones (None when there are none)."""
    col_nnz = torch.as_tensor(col_nnz, dtype=torch.float64).flatten()
    u = col_nnz.numel()
    mask = torch.zeros(u, dtype=torch.bool)
    if len(unbuilt):
        mask[torch.as_tensor(list(unbuilt), dtype=torch.long)] = True
    built = col_nnz[~mask]
    return {"unbuilt_columns": int(mask.sum()),
            "density_built": float(built.sum() / (v * built.numel())) if built.numel() else None,
            "col_nnz_mean_built": float(built.mean()) if built.numel() else None,
            "col_nnz_mean_unbuilt": float(col_nnz[mask].mean()) if mask.any() else None}


def translator_column_split(stats, unbuilt: Sequence[int]) -> dict:
    """`column_split` of a translator's current P, from its :class:`~s2t2_dist.translator.stats.PStats` (one
    collective when C is sharded: call on every rank)."""
    _, cols = stats.nnz_per_row_and_col()
    return column_split(cols, stats.tr.v, unbuilt)
