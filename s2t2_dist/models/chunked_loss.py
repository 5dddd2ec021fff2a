"""The next-token loss over a large vocabulary without the full logits: the head applied to chunks of the final
hidden states, each chunk's log-sum-exp, loss and gradients computed at once.

transformers' causal-LM forward materialises the logits of every position ([tokens, vocab], 0.8 GB in bf16 at
OLMo-1B's 16 x 512 x 50,304), and its loss upcasts them to a float32 copy (1.6 GB) whose gradient is another
1.6 GB. Here, a chunk of ``chunk`` positions at a time, the logits exist only as one float32 ``[chunk, vocab]``
block: its loss, and (since the loss is the graph's end, its gradient is the softmax minus the one-hot, scaled by
the backward's incoming scalar) the gradients for the hidden states and the head's weight are computed in the
forward and kept; the backward only scales them. No logits are recomputed and no host value is read.

The engines see nothing new: :func:`install` turns the model's own ``lm_head`` into a :class:`ChunkedLossHead`
(same parameters, names, hooks and sharding; FSDP2 and ZeRO-3 gather its weight around its forward as before),
which, inside :func:`ChunkedLossHead.armed`, returns the mean loss in place of the logits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch import Tensor

from .translated import IGNORE_INDEX


def _compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a matmul of ``t`` runs in here: autocast's when it is on for the device (as F.linear would)."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over the scored rows of ``cross_entropy(h @ W^T, targets)`` (rows with ``IGNORE_INDEX`` not scored);
    ``h`` [N, d], ``W`` [V, d], ``targets`` [N]. The gradients are formed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, targets: Tensor, chunk: int) -> Tensor:
        cd = _compute_dtype(h)
        acc = torch.promote_types(cd, torch.float32)  # the logits' and the loss's dtype: float32 at least
        with torch.autocast(h.device.type, enabled=False):
            hc, Wc = h.to(cd), W.to(cd)
            valid = targets != IGNORE_INDEX
            scale = 1.0 / valid.sum().clamp_min(1).to(acc)  # a device value: the mean without a host read
            safe = torch.where(valid, targets, 0)
            loss = torch.zeros((), dtype=acc, device=h.device)
            need = ctx.needs_input_grad
            dh = torch.empty_like(hc) if need[0] else None
            dW = torch.zeros(W.shape, dtype=acc, device=W.device) if need[1] else None
            for a in range(0, h.shape[0], chunk):
                rows = slice(a, a + chunk)
                logits = (hc[rows] @ Wc.t()).to(acc)
                lse = torch.logsumexp(logits, dim=1)
                picked = logits.gather(1, safe[rows, None]).squeeze(1)
                w = valid[rows].to(acc) * scale  # each scored row's share of the mean
                loss += ((lse - picked) * w).sum()
                if dh is None and dW is None:
                    continue
                # d loss / d logits = (softmax - onehot) * w, in place of the logits
                g = logits.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, safe[rows, None], -torch.ones_like(picked[:, None]))
                g = (g * w[:, None]).to(cd)
                if dh is not None:
                    torch.mm(g, Wc, out=dh[rows])
                if dW is not None:
                    dW += (g.t() @ hc[rows]).to(acc)
        ctx.save_for_backward(dh if dh is not None else torch.empty(0),
                              dW.to(W.dtype) if dW is not None else torch.empty(0))
        ctx.dtypes = (h.dtype, W.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        dh, dW = ctx.saved_tensors
        need = ctx.needs_input_grad
        gh = (dh * grad.to(dh.dtype)).to(ctx.dtypes[0]) if need[0] else None
        gW = (dW * grad.to(dW.dtype)).to(ctx.dtypes[1]) if need[1] else None
        return gh, gW, None, None


def chunked_next_token_loss(h: Tensor, W: Tensor, labels: Tensor, chunk: int) -> Tensor:
    """The mean next-token loss of hidden states ``h`` [B, T, d] under the head ``W`` [V, d]: position t predicts
    ``labels[:, t + 1]`` (transformers' shift; labels equal to IGNORE_INDEX are not scored)."""
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), W, targets.reshape(-1), int(chunk))


class ChunkedLossHead(nn.Linear):
    """A model's ``lm_head`` (an nn.Linear without bias) that returns the mean next-token loss instead of the
    logits while :meth:`armed`; outside it, the plain linear head (generation, evaluation, export)."""

    chunk: int = 0
    _labels: Tensor | None = None

    def forward(self, h: Tensor) -> Tensor:
        if self._labels is None:
            return super().forward(h)
        return chunked_next_token_loss(h, self.weight, self._labels, self.chunk)

    @contextlib.contextmanager
    def armed(self, labels: Tensor):
        """Inside, the model's forward returns the loss against ``labels`` as its ``logits`` (call it without
        ``labels``, so that transformers computes no loss of its own)."""
        self._labels = labels
        try:
            yield
        finally:
            self._labels = None


def install(model: nn.Module, chunk: int) -> ChunkedLossHead | None:
    """Turn ``model.lm_head`` into a ChunkedLossHead in place (its class only: parameters, tying, hooks and
    sharding stay); None when the model does not fit (no plain bias-free linear head, or logits changed after the
    head: soft-capping), so the caller keeps transformers' loss."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    cfg = getattr(model, "config", None)
    if (chunk <= 0 or type(head) is not nn.Linear or head.bias is not None
            or getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1)):
        return None
    head.__class__ = ChunkedLossHead
    head.chunk = int(chunk)
    return head
