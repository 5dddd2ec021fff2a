"""The sparse FVT start's shared part (`ot.prior.shared_start`): every column built from pieces gives
exactly 1 - init_weight of its weight to the most used pieces, whatever the source vocabulary's size v. The plain
blend of before left that share to the weight floor (units of 1/v), so it was ~0.2 of a column at v = 512 and ~0.5
at v = 49,152 for the same target tokens (benchmarks/smollm2_cpu2_2026-11-28.md). Counts, not times."""
import pytest
import torch

from s2t2_dist.ot.prior import (blend_with_uniform, decompose, fvt_plan, row_marginal, shared_rows,
                                shared_start, start_plan)
from s2t2_dist.translator.floor import floor_plan_reference


def _vocab(v):
    """A target of 64 tokens over a source of v tokens whose first 40 are the pieces (as a large source vocabulary
    holds the same pieces among many more tokens): some tokens are one piece, some two or three, one a common piece
    used by many (a skewed mu, like the protein decompositions), one has no piece."""
    pieces = [bytes([97 + i]) for i in range(20)] + [bytes([97 + i, 97 + i]) for i in range(20)]
    source = pieces + [b"#%d" % i for i in range(v - len(pieces))]
    target = [bytes([97 + i % 20]) * (1 + i % 3) + b"a" * (i % 4 == 0) for i in range(63)] + [b"~"]
    return decompose(target, source)


def _start(v, w, floor=1.0, plain=False):
    dec = _vocab(v)
    u = len(dec.pieces)
    nu = torch.full((u,), 1.0 / u, dtype=torch.float64)
    F = fvt_plan(dec, torch.full((v,), 1.0 / v, dtype=torch.float64), nu)
    mu = row_marginal(F)
    P0 = blend_with_uniform(F, mu, nu, w) if plain else shared_start(F, mu, nu, w, floor / v)
    P = floor_plan_reference(P0.clone(), P0, nu, floor)  # what the sparse kind's first forward leaves of it
    built = torch.tensor([bool(p) for p in dec.pieces])
    shared = ((P / nu) * (F == 0)).sum(0)[built]  # weight outside the column's own pieces
    return P0, P, F, mu, nu, shared, built


@pytest.mark.parametrize("w", [0.5, 0.85, 0.9])
def test_shared_part_is_one_minus_init_weight_at_every_v(w):
    for v in (64, 512, 49152):
        P0, P, F, mu, nu, shared, built = _start(v, w)
        # a column's own pieces can be among the shared rows: its weight outside them is at most 1 - w
        assert float(shared.max()) <= 1 - w + 1e-12, (v, w)
        # the floor drops nothing of a built column: the start is its own plan there (the unbuilt column keeps,
        # as before, only what of its w / v is at the floor: its shared rows)
        assert torch.equal(P0[:, built] > 0, P[:, built] > 0), (v, w)
        assert torch.allclose(P[:, built], P0[:, built], atol=1e-15), (v, w)
        assert torch.allclose(P0.sum(0), nu)
    # the same share at v = 512 and 49,152 (mu differs by the unbuilt column's nu_j / v per row, and at v = 512 a
    # light row can fall below the floor: its part goes to the other shared rows)
    big, small = _start(49152, w)[5], _start(512, w)[5]
    assert float(big.mean()) == pytest.approx(float(small.mean()), abs=0.002), (w, big, small)
    assert float(big.mean()) == pytest.approx(1 - w, abs=0.05), w


def _flat(v, w, plain):
    """384 target tokens, each one source token of its own (a flat mu, as SmolLM2's pieces of an English BPE)."""
    pieces = [bytes([97 + i // 26, 97 + i % 26]) for i in range(384)]
    dec = decompose(pieces, pieces + [b"#%d" % i for i in range(v - 384)])
    nu = torch.full((384,), 1.0 / 384, dtype=torch.float64)
    F = fvt_plan(dec, torch.full((v,), 1.0 / v, dtype=torch.float64), nu)
    mu = row_marginal(F)
    P0 = blend_with_uniform(F, mu, nu, w) if plain else shared_start(F, mu, nu, w, 1 / v)
    P = floor_plan_reference(P0.clone(), P0, nu, 1.0)
    return float(((P / nu) * (F == 0)).sum(0).mean()), float((P > 0).sum(0).double().mean())


def test_plain_blend_of_before_depended_on_v():
    """The measured cause (benchmarks/smollm2_cpu2_2026-11-28.md), on a flat mu: at the same init_weight the floor (1/v)
    dropped the old blend's whole shared part at v = 512 ((1 - w) mu_i = 0.5 / 384 < 1 / 512) and kept all of it at
    v = 49,152 (the FVT start at one v, half a mean of every row at the other). The shared start: 0.5 wherever the
    floor allows it (v >= 768 here), and FVT where a share of 0.5 over 384 tied rows would be below the floor."""
    assert _flat(512, 0.5, plain=True) == (0.0, 1.0)
    share, rows = _flat(49152, 0.5, plain=True)
    assert share == pytest.approx(0.5, abs=0.002) and rows == 384
    assert _flat(512, 0.5, plain=False) == (0.0, 1.0)  # 0.5 / 384 < 1 / 512: no row can hold it
    for v in (1024, 49152):
        share, rows = _flat(v, 0.5, plain=False)
        assert share == pytest.approx(0.5 * 383 / 384, abs=1e-9) and rows == 384, v


def test_shared_rows_are_the_most_used_and_ties_stay_whole():
    mu = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.25, 0.15, 0.0], dtype=torch.float64)
    # share * mu_i / mu(rows) >= floor_w for every kept row: rows 0 (0.3) and 4 (0.25) keep 0.5 * 0.25 / 0.55
    assert shared_rows(mu, 0.5, 0.2).tolist() == [True, False, False, False, True, False, False]
    # the three tied rows of 0.1 enter together or not at all (0.5 * 0.1 / 1.0 = 0.05)
    assert shared_rows(mu, 0.5, 0.05).tolist() == [True] * 6 + [False]
    assert shared_rows(mu, 0.5, 0.051).tolist() == [True, False, False, False, True, True, False]
    assert not bool(shared_rows(mu, 0.0, 0.01).any())  # init_weight 1: no shared part
    assert shared_rows(mu, 0.5, 0.0).tolist() == [True] * 6 + [False]  # floor 0: every row mu uses


def test_floor_zero_and_init_weight_one_are_the_plain_starts():
    dec = _vocab(512)
    nu = torch.full((64,), 1.0 / 64, dtype=torch.float64)
    F = fvt_plan(dec, torch.full((512,), 1.0 / 512, dtype=torch.float64), nu)
    mu = row_marginal(F)
    assert torch.equal(shared_start(F, mu, nu, 0.7, 0.0), blend_with_uniform(F, mu, nu, 0.7))
    assert torch.equal(shared_start(F, mu, nu, 1.0, 1 / 512), F)


@pytest.mark.parametrize("w", [0.8, 1.0])
def test_start_plan_puts_no_mass_on_rows_that_no_piece_uses(w):
    """start_plan (the stage's start under source_marginal start): the column that no piece builds is the shared
    part (w = 1, no shared part: the pieces' marginal), not FVT's uniform column over all v rows, so the start's
    marginal lives on the 40 piece rows only, at any v; the built columns are shared_start's over the pieces'
    marginal."""
    for v in (512, 49152):
        dec = _vocab(v)
        u = len(dec.pieces)
        nu = torch.full((u,), 1.0 / u, dtype=torch.float64)
        P0 = start_plan(dec, nu, v, w, 1.0 / v)
        built = torch.tensor([bool(p) for p in dec.pieces])
        assert int((~built).sum()) == 1
        mu = row_marginal(P0)
        assert int((mu > 0).sum()) <= 40 and float(mu[40:].abs().sum()) == 0.0, (v, w)
        assert torch.allclose(P0.sum(0), nu)
        F = fvt_plan(dec, torch.full((v,), 1.0 / v, dtype=torch.float64), nu)
        ref = shared_start(F, row_marginal(F[:, built]), nu, w, 1.0 / v)
        assert torch.equal(P0[:, built], ref[:, built])
        col = P0[:, ~built].squeeze(1) / nu[~built]
        rows = shared_rows(row_marginal(F[:, built]), 1.0 - w, 1.0 / v)
        expect = rows if bool(rows.any()) else row_marginal(F[:, built]) > 0
        assert torch.equal(col > 0, expect), (v, w)
        # the old composition: the unbuilt column's nu_j / v on every row reached the marginal
        old = shared_start(F, row_marginal(F), nu, w, 1.0 / v)
        assert int((row_marginal(old) > 0).sum()) == v
