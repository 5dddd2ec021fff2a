"""A frozen pretrained causal LM that reads and predicts TARGET tokens through translated embeddings / head.

S2T2 replaces the source embedding E (v x d) and head L (v x d) by E' = W^T E[src] and L' = W^T L[src] (u x d), built
each step from the trainable translator (see docs/DESIGN.md). Everything between the embedding and the head is the
pretrained network, untouched:

    h      = backbone(inputs_embeds = E'[input_ids])      # final hidden states, after the final norm
    logits = h @ L'^T                                     # [B, T, u]
    loss   = cross-entropy(logits[:, :-1], labels[:, 1:])  # HF shift convention, labels = input_ids by default

The frozen E and L are never copied per step: the translator indexes them. `materialize` turns a learned (E', L')
into a standalone HF model with vocabulary u (always UNTIED: E' != L' in general even when E == L).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hf import enable_activation_checkpointing, freeze
from s2t2_dist.errors import UnsupportedModel

#: sdpa under a name without a mask builder: transformers then builds no mask (and skips its check of the
#: position ids for packed sequences, a host sync per forward); sdpa without a mask is causal, as it is today
_CAUSAL_SDPA = "s2t2_causal_sdpa"


def _maskless_causal(config) -> bool:
    """Whether a forward without a mask may skip transformers' mask building: sdpa, and every layer fully causal
    (no sliding window: its layers need the mask built for them)."""
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "sliding_window", None):
        return False
    return all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"]))


def _register_causal_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(_CAUSAL_SDPA, sdpa_attention_forward)

IGNORE_INDEX = -100

EmbeddingsFn = Callable[[], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TranslatedOutput:
    loss: torch.Tensor  # mean NLL over the scored tokens (0-dim); 0 when nothing is scored
    nll_sum: torch.Tensor  # sum of token NLLs in nats (float32, 0-dim)
    n_tokens: torch.Tensor  # number of scored tokens (int64, 0-dim)
    logits: torch.Tensor | None = None  # [B, T, u] when asked for


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer body of an HF causal LM (`OlmoModel` / `LlamaModel` ...): embeddings -> final norm."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise UnsupportedModel(f"{type(model).__name__} has no separate base model to call with inputs_embeds")
    return body


def shifted_nll(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of NLL in nats, number of scored tokens): position t predicts labels[t + 1]; labels equal to -100 and
    positions whose target is masked out (attention_mask 0) are not scored. Computed in float32."""
    targets = labels[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    pred = logits[:, :-1]
    nll = F.cross_entropy(
        pred.reshape(-1, pred.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return nll, (targets != IGNORE_INDEX).sum()


class TranslatedLM(nn.Module):
    """Wrap a pretrained HF causal LM so it reads target ids through E' and predicts through L' (both u x d).

    Args:
        model: an HF `*ForCausalLM` (OLMo, Llama, ...; tied or untied: its own E and L are not used here).
        translator: optional callable returning (E', L') (e.g. the TokenTranslator module, which is then registered
            as a submodule so that its parameters are this module's trainable parameters). Alternatively pass E' and
            L' to `forward`.
        freeze_model: freeze the wrapped model (requires_grad False, kept in eval mode).
        gradient_checkpointing: recompute the body's activations in backward (HF gradient checkpointing,
            non-reentrant) to fit long contexts / big models; gradients still reach E' through the frozen body.
            HF only checkpoints in training mode, so the wrapped model then follows `train()`/`eval()` (dropout of
            the pretrained config, 0 for OLMo and Llama, would then apply).
    """

    def __init__(
        self,
        model: nn.Module,
        translator: EmbeddingsFn | None = None,
        freeze_model: bool = True,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        self.model = model
        self.translator = translator  # nn.Module -> registered as a submodule by nn.Module.__setattr__
        self.frozen = freeze_model
        self.gradient_checkpointing = gradient_checkpointing
        if freeze_model:
            freeze(model)
        if gradient_checkpointing:
            enable_activation_checkpointing(model)
        cfg = getattr(model, "config", None)
        self.logit_softcap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
        if cfg is not None and getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
            raise UnsupportedModel(f"{type(model).__name__} scales its logits (logit_scale); not supported")

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen and not self.gradient_checkpointing:
            self.model.eval()  # a frozen pretrained model keeps dropout off
        return self

    def _body(self) -> nn.Module:
        return backbone_of(self.model)

    def _embeddings(self, E_new, L_new):
        if E_new is None and L_new is None:
            if self.translator is None:
                raise ValueError("TranslatedLM needs E' and L': pass them, or give the wrapper a translator")
            E_new, L_new = self.translator()
        if E_new is None or L_new is None:
            raise ValueError("pass both E' and L' (or neither, to use the translator)")
        if E_new.dim() != 2 or E_new.shape != L_new.shape:
            raise ValueError(f"E' {tuple(E_new.shape)} and L' {tuple(L_new.shape)} must both be [u, d]")
        return E_new, L_new

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        E_new: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, d] of the pretrained body fed `E'[input_ids]`."""
        body = self._body()
        d = body.get_input_embeddings().weight.shape[1]
        if E_new.shape[1] != d:
            raise ValueError(f"E' has width {E_new.shape[1]}, the model's hidden size is {d}")
        emb = body.get_input_embeddings()
        # The embedding module's own forward runs with E' as its weight, so whatever it does besides the lookup
        # (Gemma's sqrt(d) scale lives in GemmaTextScaledWordEmbedding.forward) applies to E' as it did to E.
        # The source vocabulary's padding_idx means nothing for target ids (it may even lie beyond u rows, and it
        # would zero the gradient of whichever target token has that id), so the lookup runs without it.
        pad = getattr(emb, "padding_idx", None)
        try:
            if pad is not None:
                emb.padding_idx = None
            inputs_embeds = torch.func.functional_call(emb, {"weight": E_new.to(emb.weight.dtype)}, (input_ids,))
        finally:
            if pad is not None:
                emb.padding_idx = pad
        cfg = body.config
        swap = attention_mask is None and position_ids is None and _maskless_causal(cfg)
        if swap:  # training on packed blocks: no padding, causal attention without building (or checking) a mask
            _register_causal_sdpa()
            cfg._attn_implementation = _CAUSAL_SDPA
        try:
            out = body(
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                return_dict=True,
            )
        finally:
            if swap:
                cfg._attn_implementation = "sdpa"
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor, L_new: torch.Tensor) -> torch.Tensor:
        """h @ L'^T in L's dtype (float32 L' from the translator gives float32 logits)."""
        logits = F.linear(hidden.to(L_new.dtype), L_new)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        E_new: torch.Tensor | None = None,
        L_new: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_logits: bool = False,
    ) -> TranslatedOutput:
        """Next-token loss of target ids [B, T] (labels default to input_ids, shifted inside; -100 is ignored)."""
        E_new, L_new = self._embeddings(E_new, L_new)
        u = E_new.shape[0]
        # checked where it costs nothing: on a GPU it would be two host syncs per step (the stage checks its CPU
        # batches before moving them; an id out of range on the GPU fails in the embedding lookup)
        if input_ids.device.type == "cpu" and input_ids.numel():  # through numpy: a host read, no torch op
            a = input_ids.numpy()
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= u:
                raise ValueError(f"target ids must lie in [0, {u}); got [{lo}, {hi}]")
        h = self.hidden_states(input_ids, E_new, attention_mask)
        logits = self.logits(h, L_new)
        nll, n = shifted_nll(logits, input_ids if labels is None else labels, attention_mask)
        loss = nll / n.clamp(min=1).to(nll.dtype)
        return TranslatedOutput(loss=loss, nll_sum=nll, n_tokens=n, logits=logits if return_logits else None)

    @torch.no_grad()
    def logits_fn(self, E_new: torch.Tensor | None = None, L_new: torch.Tensor | None = None):
        """A function ids[B, T] -> logits[B, T, u] with fixed (E', L'), e.g. for `eval.bpb.score_documents`."""
        E_new, L_new = self._embeddings(E_new, L_new)
        E_new, L_new = E_new.detach(), L_new.detach()

        def fn(ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.logits(self.hidden_states(ids, E_new), L_new)

        return fn

    @torch.no_grad()
    def materialize(self, E_new=None, L_new=None, **kwargs):
        """`materialize(self.model, E', L')` with the translator's current (E', L') by default."""
        E_new, L_new = self._embeddings(E_new, L_new)
        return materialize(self.model, E_new, L_new, **kwargs)


@torch.no_grad()
def materialize(
    model: nn.Module,
    E_new: torch.Tensor,
    L_new: torch.Tensor,
    *,
    inplace: bool = False,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    dtype: torch.dtype | None = None,
):
    """A standalone HF causal LM with vocabulary u: embedding E', head L', everything else from `model`.

    The result is untied (config.tie_word_embeddings = False) and its config/generation config carry the TARGET
    tokenizer's special ids (the source model's ids mean nothing in the new vocabulary; unset ones become None).
    `save_pretrained` / `from_pretrained` round-trip it. With `inplace=False` (default) `model` is deep-copied first.
    The new parameters are trainable (requires_grad True); the others keep their flags (e.g. for continual
    finetuning, unfreeze as needed).
    """
    if E_new.dim() != 2 or E_new.shape != L_new.shape:
        raise ValueError(f"E' {tuple(E_new.shape)} and L' {tuple(L_new.shape)} must both be [u, d]")
    out = model if inplace else copy.deepcopy(model)
    old_emb = out.get_input_embeddings()
    u, d = E_new.shape
    if old_emb.weight.shape[1] != d:
        raise ValueError(f"E' has width {d}, the model's hidden size is {old_emb.weight.shape[1]}")
    dtype = dtype or old_emb.weight.dtype
    device = old_emb.weight.device
    old_head = out.get_output_embeddings()
    # The model's own embedding and head modules are kept and given new weights, not replaced by plain nn.Embedding /
    # nn.Linear: their class may do more than a lookup (Gemma scales embeddings by sqrt(d) in its embedding module).
    emb = _with_weight(old_emb, E_new.detach().to(device=device, dtype=dtype), "num_embeddings")
    if getattr(emb, "padding_idx", None) is not None and emb.padding_idx >= u:
        emb.padding_idx = None
    head = _with_weight(old_head, L_new.detach().to(device=device, dtype=dtype), "out_features")
    cfg = out.config
    cfg.tie_word_embeddings = False
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text_cfg.tie_word_embeddings = False
    text_cfg.vocab_size = u
    cfg.vocab_size = u
    out.set_input_embeddings(emb)
    out.set_output_embeddings(head)
    if hasattr(out, "vocab_size"):
        out.vocab_size = u
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    for k, v in ids.items():
        if v is not None and not 0 <= v < u:
            raise ValueError(f"{k}={v} outside the new vocabulary [0, {u})")
        setattr(cfg, k, v)
        if text_cfg is not cfg:
            setattr(text_cfg, k, v)
        if getattr(out, "generation_config", None) is not None:
            setattr(out.generation_config, k, v)
    assert out.get_input_embeddings().weight.data_ptr() != out.get_output_embeddings().weight.data_ptr()
    return out


def _with_weight(module: nn.Module, weight: torch.Tensor, size_attr: str) -> nn.Module:
    """A shallow copy of `module` (same class and attributes, e.g. an embedding scale) holding `weight` [u, d] as its
    own new parameter (never shared with the original: a tied model's embedding and head come apart)."""
    if getattr(module, "bias", None) is not None:
        raise NotImplementedError(f"{type(module).__name__} has a bias; S2T2 translates weights only")
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = dict(module._modules)
    new.weight = nn.Parameter(weight.clone(), requires_grad=True)
    if hasattr(new, size_attr):
        setattr(new, size_attr, weight.shape[0])
    return new
