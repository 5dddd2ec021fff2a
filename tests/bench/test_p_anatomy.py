"""bench/p_anatomy.py: a P's weight on each target token's own letters (does it translate?) and the P cut to its
k largest weights per column, written as a P file the evaluate stage reads; the script as typed on real files."""
import json
import subprocess
import sys

import pytest
import torch
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel

from bench.p_anatomy import letter_share, top_k_plan
from s2t2_dist.translator.pfile import SparseP, load_p, save_p
from tests.helpers.stage_fixtures import REPO

SRC = ["A", "B", "C", "D"]
TGT = ["", "A", "AB", "BC", "CD"]  # column 0: a special (no text)


def test_a_translation_puts_its_weight_on_its_own_letters():
    nu = torch.full((5,), 0.2, dtype=torch.float64)
    W = torch.zeros(4, 5, dtype=torch.float64)
    for j, (a, b) in enumerate([(0, 0), (0, 0), (0, 1), (1, 2), (2, 3)]):
        W[a, j] += 0.5
        W[b, j] += 0.5
    r = letter_share(W, nu, SRC, TGT)
    assert r["weight_on_own_letters"] == pytest.approx(1.0) and r["largest_weight_on_own_letter"] == 1.0
    assert r["columns"] == 4  # the special is left out
    # a flat column sits at the flat share (1 / 4 for "A", 2 / 4 for the pairs) and its largest weight is row 0's
    flat = letter_share(torch.full((4, 5), 0.25, dtype=torch.float64), nu, SRC, TGT)
    assert flat["weight_on_own_letters"] == pytest.approx(flat["flat_column_share"]) == pytest.approx(7 / 16)
    # every weight on other letters: none on its own (negative weights count as zero)
    other = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1], [0, 1, 0, 0, -1], [0, 0, 1, 1, 0]], dtype=torch.float64)
    assert letter_share(other, nu, SRC, TGT)["weight_on_own_letters"] == 0.0


def test_top_k_keeps_k_weights_a_column_at_its_nu():
    g = torch.Generator().manual_seed(0)
    P = torch.rand(6, 4, generator=g, dtype=torch.float64)
    P[:, 3] = 0
    nu = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    T, kept = top_k_plan(P, nu, 2)
    assert ((T[:, :3] > 0).sum(0) == 2).all() and (T[:, 3] == 0).all()
    assert torch.allclose(T[:, :3].sum(0), nu[:3])
    top = P.topk(2, dim=0).values.sum()
    assert kept == pytest.approx(float(top / P.sum()))
    # the kept entries are the column's largest, in the same proportions
    j = 1
    i = P[:, j].topk(2).indices
    assert float(T[i[0], j] / T[i[1], j]) == pytest.approx(float(P[i[0], j] / P[i[1], j]))
    with pytest.raises(ValueError):
        top_k_plan(P, nu, 7)


def _tokenizer(path, words, special=()):
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.add_special_tokens([AddedToken(s, special=True) for s in special])
    tok.save(str(path))
    return path


def test_the_script_as_typed(tmp_path):
    src = _tokenizer(tmp_path / "src.json", ["<unk>", "A", "B", "C", "D"], special=["<unk>"])
    tgt = _tokenizer(tmp_path / "tgt.json", ["<s>", "A", "AB", "BC", "CD"], special=["<s>"])
    P = torch.tensor([[0.0, .1, .05, 0, 0], [0, .05, .1, .05, .02], [0, .05, .05, .1, .1], [.2, 0, 0, .05, .08]])
    nu = P.sum(0)
    idx = (P != 0).nonzero().t()
    save_p(tmp_path / "P.safetensors", SparseP(idx, P[idx[0], idx[1]], P.sum(1), nu, torch.tensor([1, 2, 3, 4]),
                                              "s", "t", kind="softmax"))
    cmd = [sys.executable, "-m", "bench.p_anatomy", "--p-file", str(tmp_path / "P.safetensors"), "--source-tokenizer",
           str(src), "--target-tokenizer", str(tgt), "--top-k", "1", "--write", str(tmp_path / "top1.safetensors"),
           "--json", str(tmp_path / "r.json")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    # "A": A .1 of .2; "AB": A .05 + B .1 of .2; "BC": B .05 + C .1 of .2; "CD": C .1 + D .08 of .2
    assert rep["columns"] == 4 and rep["largest_weight_on_own_letter"] == 1.0
    assert rep["weight_on_own_letters"] == pytest.approx((.5 + .75 + .75 + .9) / 4)
    t = load_p(tmp_path / "top1.safetensors")
    assert t.kind == "unconstrained" and t.values.numel() == 5
    assert torch.allclose(t.dense().sum(0), nu)
    # a target tokenizer of another size is one line, exit 2
    small = _tokenizer(tmp_path / "small.json", ["<s>", "A"])
    r = subprocess.run(cmd[:8] + [str(small)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--target-tokenizer" in r.stderr
