"""Paired comparisons of two models scored on the same documents: the difference of their corpus BpB with a 95%
bootstrap interval over documents, and over seeds and documents together.

Pure math (numpy): no I/O. A model's scores are `evaluate`'s per-document columns (``documents``: index, nll_nats,
bytes). BpB is a ratio of corpus sums, so every resample recomputes both sums (never a mean of per-document BpB);
the two models are resampled together (the same documents, by index), which is what makes the interval paired.
Over seeds, the seeds are resampled with replacement and, within a resample, the same documents for every seed
(the held-out documents are one set, read by every seed's model).
"""
from __future__ import annotations

import math

import numpy as np

#: bootstrap resamples; the interval's ends move by ~1e-4 BpB between generator seeds at this many
N_BOOT = 4000
LN2 = math.log(2.0)


def _aligned(a: dict, b: dict) -> tuple[np.ndarray, np.ndarray]:
    """(NLL difference a - b, bytes) per document, in a's index order; the two must hold the same documents with
    the same bytes (else the comparison is void: ValueError)."""
    ia, ib = list(a["index"]), list(b["index"])
    if sorted(ia) != sorted(ib):
        raise ValueError(f"the two scores hold different documents ({len(ia)} and {len(ib)})")
    pos = {i: k for k, i in enumerate(ib)}
    order = [pos[i] for i in ia]
    ba, bb = np.asarray(a["bytes"], dtype=np.float64), np.asarray(b["bytes"], dtype=np.float64)[order]
    if not np.array_equal(ba, bb):
        raise ValueError("the two scores give the same documents different byte counts")
    d = np.asarray(a["nll_nats"], dtype=np.float64) - np.asarray(b["nll_nats"], dtype=np.float64)[order]
    return d, ba


def paired_difference(pairs: list[tuple[dict, dict]], *, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """BpB of model a minus model b, per pair (one pair a seed) and over all pairs (their mean), each with a 95%
    percentile bootstrap interval: over documents for one pair, over seeds and documents for the mean.

    Returns ``{"per_seed": [{"diff", "lo", "hi"}...], "mean": {"diff", "lo", "hi"}, "docs": n, "seeds": k}``."""
    if not pairs:
        raise ValueError("no pairs to compare")
    cols = [_aligned(a, b) for a, b in pairs]
    n = len(cols[0][0])
    if any(len(d) != n for d, _ in cols):
        raise ValueError("the seeds' scores hold different numbers of documents")
    rng = np.random.default_rng(seed)
    # the same document resamples for every seed (one held-out set), as counts per document
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)
    per_boot = np.stack([(counts @ d) / (counts @ w) / LN2 for d, w in cols])  # (seeds, n_boot)
    per_seed = []
    for (d, w), boots in zip(cols, per_boot):
        lo, hi = np.percentile(boots, [2.5, 97.5])
        per_seed.append({"diff": float(d.sum() / w.sum() / LN2), "lo": float(lo), "hi": float(hi)})
    k = len(cols)
    seed_counts = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot).astype(np.float64) / k  # (n_boot, seeds)
    means = (seed_counts * per_boot.T).sum(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    mean = float(np.mean([p["diff"] for p in per_seed]))
    return {"per_seed": per_seed, "mean": {"diff": mean, "lo": float(lo), "hi": float(hi)}, "docs": n, "seeds": k}


def claim(interval: dict, margin: float = 0.0) -> str:
    """What a difference a - b with its interval supports: "beats by > margin" (the whole interval below -margin),
    "beats" (below 0), "ties" (the interval holds 0), "loses" (above 0)."""
    if interval["hi"] < -margin and margin > 0:
        return f"beats by > {margin:g}"
    if interval["hi"] < 0:
        return "beats"
    if interval["lo"] > 0:
        return "loses"
    return "ties"
