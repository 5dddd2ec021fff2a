"""bench/letter_reading.py (a diagnostic): the training-free lines it prints beside the frozen LM's scores, the
renormalisation over the residue letters, and its refusals."""
import json
import math

import pytest
import torch

from bench.letter_reading import adaptive_bits, letter_ids, main, unigram_bits, window_bits
from s2t2_dist.recipes.reproduce_lm import residue_frequencies


def test_unigram_is_add_one_smoothed_over_the_alphabet():
    p = residue_frequencies(["AAB"], ["A", "B", "C"])
    assert p == pytest.approx({"A": 3 / 6, "B": 2 / 6, "C": 1 / 6})
    assert unigram_bits(p, ["AC"]) == pytest.approx(-math.log2(0.5) - math.log2(1 / 6))


def test_adaptive_unigram_learns_a_sequences_own_composition():
    p = residue_frequencies(["ABCD" * 50], list("ABCD"))
    biased = ["A" * 300]
    # a sequence of one letter costs far less once its own counts are read; a huge prior weight is the unigram
    assert adaptive_bits(p, biased, 10) < 0.2 * unigram_bits(p, biased)
    assert adaptive_bits(p, biased, 1e12) == pytest.approx(unigram_bits(p, biased), rel=1e-6)
    # its first letter is scored by the prior alone
    assert adaptive_bits(p, ["B"], 10) == pytest.approx(-math.log2(p["B"]))


def test_window_bits_renormalises_over_the_allowed_ids():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0 + 1e-30]]))
    assert window_bits(logits, torch.tensor([0])) == pytest.approx(1.0)
    # over ids {0, 1} token 0 holds 2/3 of the mass: log2(3/2) bits
    assert window_bits(logits, torch.tensor([0]), torch.tensor([0, 1])) == pytest.approx(math.log2(1.5))


class _Tok:
    unk_token_id = 0
    vocab = {"A": 5, "B": 6, "AB": 7}

    def convert_tokens_to_ids(self, t):
        return self.vocab.get(t, 0)

    def decode(self, ids):
        return {v: k for k, v in self.vocab.items()}[ids[0]]


def test_letter_ids_are_the_models_own_single_letter_tokens():
    assert letter_ids(_Tok(), ["A", "B"]) == [5, 6]
    with pytest.raises(ValueError, match="'C'"):
        letter_ids(_Tok(), ["A", "C"])


def test_refusals_name_the_argument(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--splits", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path), "--splits", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "--splits" in err and "split.json" in err
    (tmp_path / "s" / "train").mkdir(parents=True)
    (tmp_path / "s" / "train" / "part-0.jsonl").write_text(json.dumps({"text": "AB"}) + "\n")
    assert main(["--model", str(tmp_path), "--splits", str(tmp_path / "s"), "--window", "0"]) == 2
    assert "--window" in capsys.readouterr().err
