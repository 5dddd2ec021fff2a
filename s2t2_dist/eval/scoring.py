"""Distributed, batched scoring of eval documents for models whose forward may be a collective.

Each rank scores its own documents (`data.EvalDocs` gives each document to exactly one rank) with the rolling
windows of `eval.bpb` (every token after the document's first scored exactly once, from as much context as fits),
several windows per forward call (right-padded: a causal LM's predictions at real positions do not depend on the
padding after them). The totals are exact sums over ranks (`EvalTotals.all_reduce`), so the result is the same for
any number of ranks up to float rounding.

Under ZeRO-3 and FSDP2 every forward gathers parameters collectively, so all ranks must make the same number of
forward calls: before each call the ranks agree (one tiny all-reduce) whether anyone still has work, and a rank
that has run out makes a one-token dummy call whose result is discarded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from s2t2_dist.errors import ConfigError
from s2t2_dist.distributed import collectives as coll
from s2t2_dist.eval.bpb import EvalTotals, rolling_windows


@dataclass
class ScoringConfig:
    """The `eval:` section of translate and finetune: how the lock-step scorer batches its windows."""

    #: rolling windows scored per forward call (right-padded); the documents are those of global index <
    #: train.eval_max_docs (0: all), the same set at any number of ranks
    batch_size: int = 8

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be >= 1, got {self.batch_size}")

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def hf_logits_fn(module: torch.nn.Module, device: torch.device, autocast_dtype: torch.dtype | None = None) -> LogitsFn:
    """ids[B, T] -> logits[B, T, V] of a transformers causal LM (or an engine wrapping one)."""

    def fn(ids: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        with torch.no_grad(), ctx:
            return module(input_ids=ids.to(device), use_cache=False).logits

    return fn


def _windows(docs: Iterable[dict], context_len: int, max_docs: int) -> Iterator[tuple[int, torch.Tensor, int, int]]:
    """(the document's global index, input ids, first scored position in the window, n_bytes or -1) per window;
    n_bytes is given with the document's first window only. Documents whose global `index` is >= max_docs (when
    max_docs > 0) are skipped, so the evaluated set does not depend on the number of ranks."""
    k = 0
    for doc in docs:
        index = int(doc.get("index", k))
        if max_docs and index >= max_docs:
            break
        ids = torch.as_tensor(doc["input_ids"], dtype=torch.long)
        n = ids.numel() - 1
        if n < 1:
            if int(doc["n_bytes"]):
                raise ValueError(f"document {doc.get('id', '?')} with {doc['n_bytes']} bytes has no tokens to score")
            continue
        for w, (start, end, first) in enumerate(rolling_windows(n, context_len)):
            # feed ids[start:end+1]: the last input position predicts nothing; targets are ids[first..end]
            yield index, ids[start:end + 1], first - start - 1, (int(doc["n_bytes"]) if w == 0 else -1)
        k += 1


@dataclass
class DocScores:
    """Each scored document's NLL (nats), tokens and bytes by its global index: what a paired comparison of two
    models over the same documents resamples (a corpus total alone has no interval)."""

    nll_nats: dict[int, float]
    tokens: dict[int, int]
    bytes: dict[int, int]

    @classmethod
    def empty(cls) -> DocScores:
        return cls({}, {}, {})

    def gathered(self) -> DocScores:
        """Every rank's documents (collective when distributed): each document is scored by exactly one rank."""
        if not coll.distributed():
            return self
        out = DocScores.empty()
        for part in coll.all_gather_object((self.nll_nats, self.tokens, self.bytes)):
            out.nll_nats.update(part[0])
            out.tokens.update(part[1])
            out.bytes.update(part[2])
        return out

    def to_dict(self) -> dict:
        """Columns in index order (small: three numbers a document)."""
        idx = sorted(self.nll_nats)
        return {"index": idx, "nll_nats": [self.nll_nats[i] for i in idx], "tokens": [self.tokens[i] for i in idx],
                "bytes": [self.bytes[i] for i in idx]}


def _any_rank(flag: bool, lockstep: bool) -> bool:
    if not lockstep:
        return flag
    return coll.any_rank(flag)


@torch.no_grad()
def score_documents_batched(
    logits_fn: LogitsFn,
    docs: Iterable[dict],
    context_len: int,
    *,
    batch_size: int = 8,
    pad_id: int = 0,
    max_docs: int = 0,
    lockstep: bool | None = None,
    per_doc: DocScores | None = None,
) -> EvalTotals:
    """This rank's totals (not yet reduced); with `per_doc`, each of its documents' scores there too. `lockstep`
    (default: whenever torch.distributed is initialised with more than one rank) makes every rank call `logits_fn`
    the same number of times."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if lockstep is None:
        lockstep = coll.distributed()
    totals = EvalTotals()
    windows = _windows(docs, context_len, max_docs)
    done = False
    while True:
        batch = []
        while not done and len(batch) < batch_size:
            try:
                batch.append(next(windows))
            except StopIteration:
                done = True
        if not _any_rank(bool(batch), lockstep):
            break
        if not batch:  # this rank is out of documents; the others are not: a discarded dummy call
            logits_fn(torch.full((1, 1), pad_id, dtype=torch.long))
            continue
        T = max(w[1].numel() for w in batch) - 1
        inp = torch.full((len(batch), T), pad_id, dtype=torch.long)
        for i, (_, ids, _, _) in enumerate(batch):
            inp[i, :ids.numel() - 1] = ids[:-1]
        logits = logits_fn(inp)
        nlls = []  # one host sync per forward call, not one per window
        for i, (index, ids, keep, n_bytes) in enumerate(batch):
            m = ids.numel() - 1
            tgt = ids[1:][keep:].to(logits.device)
            nlls.append(F.cross_entropy(logits[i, keep:m].float(), tgt, reduction="sum").double())
            if n_bytes >= 0:  # the document's first window: count it
                totals.add(EvalTotals(0.0, 0, n_bytes, 1))
                if per_doc is not None:
                    per_doc.bytes[index] = n_bytes
            totals.tokens += tgt.numel()
            if per_doc is not None:
                per_doc.tokens[index] = per_doc.tokens.get(index, 0) + tgt.numel()
        window_nll = torch.stack(nlls).cpu().tolist()
        totals.nll_nats += sum(window_nll)
        if per_doc is not None:
            for (index, *_), x in zip(batch, window_nll):
                per_doc.nll_nats[index] = per_doc.nll_nats.get(index, 0.0) + x
    return totals


def evaluate_documents(logits_fn: LogitsFn, docs: Iterable[dict], context_len: int, *, vocab_size: int,
                       batch_size: int = 8, pad_id: int = 0, max_docs: int = 0
                       ) -> tuple[dict[str, float], EvalTotals, DocScores]:
    """Metrics over all ranks' documents (collective): perplexity per token, BpB, and the random-guess line ln u;
    the totals; every document's own scores."""
    per_doc = DocScores.empty()
    local = score_documents_batched(logits_fn, docs, context_len, batch_size=batch_size, pad_id=pad_id,
                                    max_docs=max_docs, per_doc=per_doc)
    total = local.all_reduce()
    return total.metrics(vocab_size=vocab_size), total, per_doc.gathered()
