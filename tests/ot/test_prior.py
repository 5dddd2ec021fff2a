"""The surface-string start (ot.prior) and translator.init=fvt: decomposition, a valid plan, the blend."""
import torch

from s2t2_dist.ot.prior import blend_with_uniform, decompose, fvt_plan
from s2t2_dist.translator import TokenTranslator


def test_greedy_longest_match_and_coverage():
    source = [None, b"a", b"b", b"ab", b"abc", b" t", b"he"]
    target = [None, b"abcab", b" the", b"zz", b"ab", b"xa"]
    dec = decompose(target, source, special_pairs={0: 0})
    assert dec.pieces[0] == [0]  # paired by role
    assert dec.pieces[1] == [4, 3]  # "abc" + "ab", not "ab" + "c"...
    assert dec.pieces[2] == [5, 6]
    assert dec.pieces[3] == []  # no source token covers z
    assert dec.pieces[4] == [3] and dec.pieces[5] == [1]
    assert dec.empty == 1 and dec.identical == 1
    assert dec.total_bytes == 5 + 4 + 2 + 2 + 2 and dec.covered_bytes == 5 + 4 + 0 + 2 + 1


def test_fvt_plan_columns_are_fvt_means_and_blend_keeps_nu():
    source = [b"a", b"b", b"ab"]
    target = [b"aab", b"b", b"q"]
    mu = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    nu = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    P = fvt_plan(decompose(target, source), mu, nu)
    W = P / nu
    assert torch.allclose(W[:, 0], torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64))  # "a" + "ab"
    assert torch.allclose(W[:, 1], torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(W[:, 2], mu)  # not decomposable: uniform column
    P0 = blend_with_uniform(P, mu, nu, 0.25)
    assert torch.allclose(P0.sum(0), nu) and bool((P0 > 0).all())
    assert torch.allclose(P0, 0.25 * P + 0.75 * mu[:, None] * nu[None, :])


def test_every_translator_starts_near_the_prior():
    torch.manual_seed(0)
    v, u = 6, 5
    source = [b"a", b"b", b"c", b"d", b"e", b"f"]
    target = [b"a", b"bc", b"def", b"ff", b"x"]
    mu = torch.full((v,), 1.0 / v, dtype=torch.float64)
    nu = torch.full((u,), 1.0 / u, dtype=torch.float64)
    P0 = blend_with_uniform(fvt_plan(decompose(target, source), mu, nu), mu, nu, 0.9)
    for kind in ("sparse", "softmax", "unconstrained"):
        tr = TokenTranslator(v, u, kind=kind, n_iter=50, dtype=torch.float64)
        tr.init_from_dense(P0)
        W = tr.weights(tr.P().detach())
        # the largest weight of each decomposable column is one of its pieces
        assert W[:, 0].argmax() == 0 and W[:, 1].argmax() in (1, 2) and W[:, 2].argmax() in (3, 4, 5), kind
        assert W[:, 3].argmax() == 5, kind
        if kind != "sparse":  # the dense kinds reproduce P0's columns exactly
            assert torch.allclose(tr.P().detach().sum(0), nu, atol=1e-6)
