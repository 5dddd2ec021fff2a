"""Paired bootstrap intervals of a BpB difference over documents and seeds (eval/paired.py)."""
import math

import numpy as np
import pytest

from s2t2_dist.eval.paired import claim, paired_difference


def scores(nll, nbytes, index=None):
    return {"index": list(range(len(nll))) if index is None else index, "nll_nats": list(nll), "bytes": list(nbytes)}


def test_the_difference_is_of_corpus_sums_and_its_interval_is_paired():
    rng = np.random.default_rng(1)
    nbytes = rng.integers(50, 2000, size=150)
    base = nbytes * math.log(2) * 4.2 * rng.lognormal(0, 0.1, size=150)  # ~4.2 BpB, documents vary a lot
    better = base - nbytes * math.log(2) * 0.01  # 0.01 BpB better on every byte
    r = paired_difference([(scores(better, nbytes), scores(base, nbytes))])
    hand = (better.sum() - base.sum()) / (math.log(2) * nbytes.sum())
    assert r["per_seed"][0]["diff"] == pytest.approx(hand, rel=1e-12) == pytest.approx(-0.01, rel=1e-9)
    # paired: the documents' own spread (sd ~0.4 BpB) cancels, the interval is tight around the difference
    p = r["per_seed"][0]
    assert p["lo"] <= p["diff"] <= p["hi"] and p["hi"] - p["lo"] < 1e-3
    assert claim(p) == "beats" and claim(p, 0.005) == "beats by > 0.005" and claim(p, 0.02) == "beats"
    # the same model against itself ties, exactly
    same = paired_difference([(scores(base, nbytes), scores(base, nbytes))])["mean"]
    assert same == {"diff": 0.0, "lo": 0.0, "hi": 0.0} and claim(same) == "ties"


def test_noise_without_a_difference_ties_and_seeds_widen_the_interval():
    rng = np.random.default_rng(2)
    nbytes = rng.integers(100, 1000, size=157)
    pairs = []
    for s in range(3):  # each seed's model is off by its own constant (+-0.01 BpB) and per-document noise
        off = (-0.01, 0.0, 0.01)[s]
        a = nbytes * math.log(2) * (4.2 + off + rng.normal(0, 0.02, size=157))
        b = nbytes * math.log(2) * (4.2 + rng.normal(0, 0.02, size=157))
        pairs.append((scores(a, nbytes), scores(b, nbytes)))
    r = paired_difference(pairs)
    assert r["seeds"] == 3 and r["docs"] == 157 and claim(r["mean"]) == "ties"
    assert r["mean"]["lo"] < -0.005 and r["mean"]["hi"] > 0.005  # the seeds' spread is in the interval
    assert [claim(p) for p in r["per_seed"]] == ["beats", "ties", "loses"]


def test_documents_are_matched_by_index_and_must_be_the_same():
    a = scores([1.0, 2.0, 3.0], [10, 20, 30])
    b = scores([3.0, 1.0, 2.0], [30, 10, 20], index=[2, 0, 1])  # the same documents in another order
    assert paired_difference([(a, b)])["mean"]["diff"] == 0.0
    with pytest.raises(ValueError, match="different documents"):
        paired_difference([(a, scores([1.0, 2.0], [10, 20]))])
    with pytest.raises(ValueError, match="different byte counts"):
        paired_difference([(a, scores([1.0, 2.0, 3.0], [10, 20, 31]))])
