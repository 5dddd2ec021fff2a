"""TranslatedLM: equivalence with the HF model restricted to a subset of ids (OLMo tied/untied, Llama), losses and
sums, gradients reaching only E'/L', and materialize -> save_pretrained -> from_pretrained."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from s2t2_dist.models.hf import get_embedding_and_head
from s2t2_dist.recipes.llama2c import load_llama2c
from s2t2_dist.recipes.tiny import tiny_from_config
from s2t2_dist.models.translated import TranslatedLM, materialize

U = 96


def _models():
    return {
        "olmo-1b": tiny_from_config("olmo-1b", vocab=512, seed=11),  # tied
        "olmo-7b": tiny_from_config("olmo-7b", vocab=512, seed=12),  # untied
        "llama2c": load_llama2c(),  # real trained Llama (tied)
    }


@pytest.fixture(scope="module")
def models():
    return _models()


def _ids(seed, shape=(3, 21), u=U):
    return torch.randint(0, u, shape, generator=torch.Generator().manual_seed(seed))


class FixedTranslator(nn.Module):
    """Stand-in for the TokenTranslator: E' = W^T E[src], L' = W^T L[src] with a trainable W (v_src x u)."""

    def __init__(self, E, L, src, u, seed=0):
        super().__init__()
        self.register_buffer("E", E.detach()[src])
        self.register_buffer("L", L.detach()[src])
        g = torch.Generator().manual_seed(seed)
        self.C = nn.Parameter(torch.randn(len(src), u, generator=g))

    def forward(self):
        W = self.C.softmax(0)
        return W.T @ self.E, W.T @ self.L


@pytest.mark.parametrize("name", ["olmo-1b", "olmo-7b", "llama2c"])
def test_identity_translation_equals_restricted_model(models, name):
    model = models[name]
    E, L, tied = get_embedding_and_head(model)
    assert tied is (name != "olmo-7b")
    ids = _ids(1)
    tlm = TranslatedLM(model)
    out = tlm(ids, E[:U], L[:U], return_logits=True)
    with torch.no_grad():
        ref = model(ids).logits[..., :U]
    assert out.logits.shape == (3, 21, U)
    assert torch.allclose(out.logits, ref, atol=1e-5), float((out.logits - ref).abs().max())
    # loss = mean shifted CE over B*(T-1) tokens; sums returned for evaluation
    ref_nll = F.cross_entropy(ref[:, :-1].reshape(-1, U), ids[:, 1:].reshape(-1), reduction="sum")
    assert int(out.n_tokens) == 3 * 20
    assert torch.allclose(out.nll_sum, ref_nll, rtol=1e-5)
    assert torch.allclose(out.loss, ref_nll / 60, rtol=1e-5)
    if name != "llama2c":  # on the full vocabulary the wrapper's loss is HF's own loss
        Ef, Lf = E.detach(), L.detach()
        assert torch.allclose(tlm(ids, Ef, Lf).loss, model(ids, labels=ids).loss, rtol=1e-5)


def test_permuted_subset_and_masks(models):
    model = models["olmo-7b"]
    E, L, _ = get_embedding_and_head(model)
    src = torch.randperm(512, generator=torch.Generator().manual_seed(3))[:U]
    ids = _ids(2)
    tlm = TranslatedLM(model)
    out = tlm(ids, E[src], L[src], return_logits=True)
    with torch.no_grad():
        ref = model(src[ids]).logits[..., src]
    assert torch.allclose(out.logits, ref, atol=1e-5)
    # ignored labels and padding: only the scored tokens count
    labels = ids.clone()
    labels[0, 5:] = -100
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    o2 = tlm(ids, E[src], L[src], labels=labels, attention_mask=mask)
    assert int(o2.n_tokens) == 4 + 14 + 20
    with pytest.raises(ValueError, match="target ids must lie"):
        tlm(ids + U, E[src], L[src])


def test_gradients_reach_only_the_translator(models):
    model = models["olmo-1b"]
    E, L, _ = get_embedding_and_head(model)
    tr = FixedTranslator(E, L, torch.arange(200), U)
    tlm = TranslatedLM(model, tr)
    trainable = [n for n, p in tlm.named_parameters() if p.requires_grad]
    assert trainable == ["translator.C"]
    tlm.train()
    assert not model.training  # the frozen model stays in eval mode
    out = tlm(_ids(4))
    out.loss.backward()
    assert tr.C.grad is not None and tr.C.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    # a few optimizer steps on C lower the loss: the wrapper is trainable end to end
    opt = torch.optim.Adam(tr.parameters(), lr=0.5)
    ids = _ids(5)
    first = tlm(ids).loss.item()
    for _ in range(5):
        opt.zero_grad()
        tlm(ids).loss.backward()
        opt.step()
    assert tlm(ids).loss.item() < first - 0.05


def test_bf16_backbone_float32_translator(models):
    model = tiny_from_config("olmo-7b", vocab=512, seed=12, dtype=torch.bfloat16)
    E, L, _ = get_embedding_and_head(model)
    tlm = TranslatedLM(model)
    out = tlm(_ids(6), E[:U].float(), L[:U].float(), return_logits=True)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.loss)
    ref = models["olmo-7b"]
    ref_out = TranslatedLM(ref)(_ids(6), *(t[:U] for t in get_embedding_and_head(ref)[:2]))
    assert abs(float(out.loss) - float(ref_out.loss)) < 0.05


@pytest.mark.parametrize("name", ["olmo-1b", "olmo-7b"])
def test_materialize_round_trip(models, name, tmp_path):
    from transformers import AutoModelForCausalLM

    model = models[name]
    E, L, _ = get_embedding_and_head(model)
    tr = FixedTranslator(E, L, torch.arange(300), U, seed=7)
    tlm = TranslatedLM(model, tr)
    ids = _ids(8)
    with torch.no_grad():
        want = tlm(ids, return_logits=True).logits
    E_before = E.detach().clone()
    standalone = tlm.materialize(eos_token_id=2, pad_token_id=0)
    assert torch.equal(E, E_before) and model.config.vocab_size == 512  # the wrapped model is untouched
    standalone.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.vocab_size == U and loaded.config.tie_word_embeddings is False
    assert (loaded.config.eos_token_id, loaded.config.pad_token_id, loaded.config.bos_token_id) == (2, 0, None)
    E2, L2, tied2 = get_embedding_and_head(loaded)
    assert not tied2 and E2.shape == (U, 64)
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    # and its HF loss is the wrapper's loss
    assert torch.allclose(loaded(ids, labels=ids).loss, tlm(ids).loss, rtol=1e-5)


def test_materialize_llama_inplace_and_checks(tmp_path):
    from transformers import AutoModelForCausalLM

    model = load_llama2c()
    E, L, _ = get_embedding_and_head(model)
    Ep, Lp = E.detach()[:U].clone(), (L.detach()[:U] * 0.5).clone()  # E' != L' although E == L
    ids = _ids(9)
    with torch.no_grad():
        want = TranslatedLM(model)(ids, Ep, Lp, return_logits=True).logits
    with pytest.raises(ValueError, match="outside the new vocabulary"):
        materialize(model, Ep, Lp, eos_token_id=U)
    out = materialize(model, Ep, Lp, inplace=True, bos_token_id=1, eos_token_id=2)
    assert out is model and model.config.vocab_size == U
    out.save_pretrained(tmp_path / "llama")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, want, atol=1e-5)
    assert not loaded.config.tie_word_embeddings
    with pytest.raises(ValueError, match="must both be"):
        materialize(model, Ep, Lp[:, :10])


def test_gradient_checkpointing_same_loss_and_grads():
    E, L, _ = get_embedding_and_head(tiny_from_config("olmo-7b", vocab=512, seed=12))
    ids = _ids(10)
    results = []
    for ckpt in (False, True):
        model = tiny_from_config("olmo-7b", vocab=512, seed=12)
        tr = FixedTranslator(E, L, torch.arange(200), U, seed=1)
        tlm = TranslatedLM(model, tr, gradient_checkpointing=ckpt).train()
        calls = []
        layer = model.model.layers[0]
        if ckpt:  # count runs of the checkpointed layer function: forward, then recomputation in backward
            run = layer._gradient_checkpointing_func

            def counting(fn, *a, **k):
                return run(lambda *aa, **kk: (calls.append(1), fn(*aa, **kk))[1], *a, **k)

            layer._gradient_checkpointing_func = counting
        out = tlm(ids)
        out.loss.backward()
        results.append((out.loss.detach(), tr.C.grad.clone()))
        assert len(calls) == (2 if ckpt else 0)
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_source_padding_idx_does_not_apply_to_target_ids(models):
    """A source model's padding_idx (here 80 < U and, separately, beyond u rows) must neither refuse E' nor zero
    the gradient of the target token that happens to have that id."""
    model = models["olmo-1b"]
    emb = model.get_input_embeddings()
    E, L, _ = get_embedding_and_head(model)
    old = emb.padding_idx
    try:
        for pad, u in ((80, U), (400, 64)):
            emb.padding_idx = pad
            E_new = E[:u].detach().clone().requires_grad_(True)
            ids = torch.full((1, 4), min(pad, u - 1))
            out = TranslatedLM(model)(ids, E_new, L[:u].detach(), return_logits=True)
            out.logits.sum().backward()
            assert E_new.grad[ids[0, 0]].abs().sum() > 0
            assert emb.padding_idx == pad  # restored
    finally:
        emb.padding_idx = old
