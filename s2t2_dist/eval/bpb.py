"""Perplexity and bits-per-byte as lm-evaluation-harness computes them.

BpB = (sum over documents of token NLLs in nats) / (ln 2 * sum of the documents' UTF-8 bytes): a ratio of corpus
sums, never a mean of per-document ratios. Every token of a document after its BOS is scored exactly once, each
from as much preceding context as fits (rolling windows, as the harness's `loglikelihood_rolling`), so the bytes
counted are exactly the bytes of the scored tokens, whatever the tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from s2t2_dist.distributed import collectives as coll


@dataclass
class EvalTotals:
    nll_nats: float = 0.0
    tokens: int = 0
    bytes: int = 0
    docs: int = 0

    def add(self, other: EvalTotals) -> None:
        self.nll_nats += other.nll_nats
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.docs += other.docs

    def all_reduce(self) -> EvalTotals:
        """Exact totals over ranks (sums, not averages of averages); float64 for the NLL sum."""
        if not coll.distributed():
            return self
        t = coll.sum_scalars([self.nll_nats, self.tokens, self.bytes, self.docs])
        return EvalTotals(t[0], int(round(t[1])), int(round(t[2])), int(round(t[3])))

    def metrics(self, vocab_size: int | None = None) -> dict[str, float]:
        if self.tokens == 0 or self.bytes == 0:
            raise ValueError("evaluation scored no tokens: is the eval split empty?")
        nll_tok = self.nll_nats / self.tokens
        out = {
            "nll_per_token": nll_tok,
            "perplexity": math.exp(min(nll_tok, 700.0)),
            "bpb": self.nll_nats / (math.log(2) * self.bytes),
            "tokens": float(self.tokens),
            "bytes": float(self.bytes),
            "docs": float(self.docs),
            "bytes_per_token": self.bytes / self.tokens,
        }
        if vocab_size:
            # The "random guess" line: a uniform prediction costs ln(u) nats per token.
            out["random_guess_nll_per_token"] = math.log(vocab_size)
            out["random_guess_bpb"] = math.log(vocab_size) * self.tokens / (math.log(2) * self.bytes)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def rolling_windows(n: int, context_len: int) -> list[tuple[int, int, int]]:
    """Windows over a document of n+1 tokens (BOS + n scored ones) for a model that sees `context_len` tokens.

    Returns (start, end, first_scored): feed ids[start:end], score the predictions of ids[first_scored:end+1]...
    expressed as target positions: targets ids[t] for t in [first_scored, end+1) with end+1 <= n+1. Every target
    1..n appears in exactly one window, and each window after the first keeps a full context behind its targets.
    """
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    out = []
    t = 1
    while t <= n:
        stop = min(t + context_len, n + 1)  # targets t..stop-1
        start = max(stop - 1 - context_len, 0)  # inputs start..stop-2 (<= context_len of them)
        out.append((start, stop - 1, t))
        t = stop
    return out


@torch.no_grad()
def score_documents(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    docs: Iterable[dict],
    context_len: int,
    device: torch.device | str = "cpu",
) -> EvalTotals:
    """Sum of token NLLs over documents `{"input_ids": LongTensor[n+1] (BOS first), "n_bytes": int}`.

    `logits_fn(ids[1, T]) -> logits[1, T, V]` is the model in the target vocabulary.
    """
    totals = EvalTotals()
    for doc in docs:
        ids = torch.as_tensor(doc["input_ids"], dtype=torch.long)
        n = ids.numel() - 1
        if n < 1:
            continue_bytes = int(doc["n_bytes"])
            if continue_bytes:
                raise ValueError(f"document with {continue_bytes} bytes has no tokens to score")
            continue
        nll = 0.0
        for start, end, first in rolling_windows(n, context_len):
            inp = ids[start:end].unsqueeze(0).to(device)
            logits = logits_fn(inp)[0].float()
            # position p of the window predicts ids[start + p + 1]; keep targets >= first
            targets = ids[start + 1 : end + 1].to(device)
            keep = first - (start + 1)
            nll += float(F.cross_entropy(logits[keep:], targets[keep:], reduction="sum").double())
        totals.add(EvalTotals(nll, n, int(doc["n_bytes"]), 1))
    return totals
