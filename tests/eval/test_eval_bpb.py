import math

import pytest
import torch

from s2t2_dist.eval.bpb import EvalTotals, rolling_windows, score_documents


@pytest.mark.parametrize("n", [1, 2, 5, 7, 8, 9, 31])
@pytest.mark.parametrize("ctx", [1, 3, 8])
def test_rolling_windows_score_every_token_once(n, ctx):
    seen = []
    for start, end, first in rolling_windows(n, ctx):
        assert 0 <= start < end <= n and end - start <= ctx
        seen.extend(range(first, end + 1))
        assert first >= start + 1
    assert seen == list(range(1, n + 1))


def test_bpb_of_uniform_byte_model_is_8_bits():
    """Tokenizer-independent case by hand: a byte-level model predicting uniformly over 256 symbols codes every
    byte with exactly 8 bits, whatever the text and the context length."""
    texts = ["MKTAYIAKQR", "hello, world", "Once upon a time"]
    docs = [{"input_ids": torch.tensor([0] + list(t.encode())), "n_bytes": len(t.encode())} for t in texts]
    def uniform(ids):
        return torch.zeros(ids.shape[0], ids.shape[1], 256)

    tot = score_documents(uniform, docs, context_len=4)
    m = tot.metrics(vocab_size=256)
    assert tot.tokens == tot.bytes == sum(len(t) for t in texts)
    assert m["bpb"] == pytest.approx(8.0) and m["perplexity"] == pytest.approx(256.0)
    assert m["random_guess_bpb"] == pytest.approx(8.0)


def test_bpb_is_ratio_of_sums_and_hand_value():
    """Two tokenizations of the same bytes: a 2-token doc of 6 bytes and a 1-token doc of 2 bytes."""
    # a model that always puts probability 1/2 on token 1 and 1/2 spread over the other 3 tokens (V = 4)
    def fn(ids):
        logits = torch.full((ids.shape[0], ids.shape[1], 4), math.log(1 / 6))
        logits[..., 1] = math.log(1 / 2)
        return logits

    docs = [{"input_ids": torch.tensor([0, 1, 2]), "n_bytes": 6}, {"input_ids": torch.tensor([0, 1]), "n_bytes": 2}]
    tot = score_documents(fn, docs, context_len=8)
    expect_nll = math.log(2) + math.log(6) + math.log(2)
    assert tot.nll_nats == pytest.approx(expect_nll)
    assert tot.metrics()["bpb"] == pytest.approx(expect_nll / (math.log(2) * 8))
    # the mean of per-document ratios would differ: make sure we did not compute that
    per_doc = ((math.log(2) + math.log(6)) / (math.log(2) * 6) + math.log(2) / (math.log(2) * 2)) / 2
    assert tot.metrics()["bpb"] != pytest.approx(per_doc)


def test_rolling_context_is_respected():
    """The model sees at most context_len tokens per call."""
    calls = []

    def fn(ids):
        calls.append(ids.shape[1])
        return torch.zeros(1, ids.shape[1], 10)

    score_documents(fn, [{"input_ids": torch.arange(20) % 10, "n_bytes": 19}], context_len=6)
    assert max(calls) <= 6 and sum(calls) >= 19


def test_empty_eval_is_an_error():
    with pytest.raises(ValueError, match="no tokens"):
        EvalTotals().metrics()
