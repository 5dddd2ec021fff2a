"""The chunked next-token loss (s2t2_dist/models/chunked_loss.py): exact against cross-entropy over the full logits
(value and both gradients, ignored targets, chunks that do not divide the rows), the same model outputs and
training through a real HF model's head, and the same loss curve in every engine (plain; FSDP2 and DeepSpeed
ZeRO-3 on 2 gloo ranks) with the chunked loss on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_distributed
from tests.helpers.engines_tiny import tiny_olmo

from s2t2_dist.models.chunked_loss import ChunkedLinearCrossEntropy, ChunkedLossHead, install


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_exact_against_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(21, 8, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (21,), generator=g)
    t[[0, 5, 20]] = -100
    ref = F.cross_entropy(h @ W.t(), t, ignore_index=-100)
    ref_grads = torch.autograd.grad(3.0 * ref, (h, W))
    got = ChunkedLinearCrossEntropy.apply(h, W, t, chunk)
    grads = torch.autograd.grad(3.0 * got, (h, W))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # nothing scored: loss 0 and zero gradients, not NaN
    none = ChunkedLinearCrossEntropy.apply(h, W, torch.full((21,), -100), chunk)
    assert none.item() == 0.0 and not torch.autograd.grad(none, h)[0].any()


def test_a_real_model_head_gives_transformers_loss_and_gradients():
    ref, model = tiny_olmo(tie=True, seed=1), tiny_olmo(tie=True, seed=1)
    keys = list(model.state_dict())
    head = install(model, chunk=5)
    assert isinstance(head, ChunkedLossHead) and head is model.lm_head
    assert list(model.state_dict()) == keys and model.lm_head.weight is model.model.embed_tokens.weight  # tied
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    with head.armed(ids):
        got = model(input_ids=ids).logits
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # outside `armed`: the plain head (evaluation, generation, export)
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # a head the loss cannot replace keeps transformers' loss
    assert install(tiny_olmo(seed=1), chunk=0) is None
    biased = tiny_olmo(seed=1)
    biased.lm_head = torch.nn.Linear(64, 512, bias=True)
    assert install(biased, chunk=8) is None


def _engine_losses(kind: str, model_dir: str, steps: int = 3) -> dict[int, list[float]]:
    """`steps` optimiser steps of the finetune stage's engine with the chunked loss off (0) and on (5 positions a
    chunk), each from the same weights and batch: {chunk: losses}."""
    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.engines.build import EngineConfig, build_model_and_engine, engine_kind
    from s2t2_dist.models.chunked_loss import install
    from s2t2_dist.stages.common import teardown
    from s2t2_dist.train.config import OptimConfig, TrainConfig

    engine_kind(kind).init_distributed()
    world, rank = coll.world_size(), coll.rank()
    ids = torch.randint(2, 512, (world, 2, 16), generator=torch.Generator().manual_seed(3))[rank]
    out = {}
    for chunk in (0, 5):
        ecfg = EngineConfig(kind=kind, loss_chunk_tokens=chunk, activation_checkpointing=False,
                            ds_config="configs/ds_zero3.json" if kind == "deepspeed" else None)
        tcfg = TrainConfig(steps=steps, batch_size=2 * world, micro_batch_size=2, context_len=16, precision="fp32")
        _, engine = build_model_and_engine(ecfg, model_dir, OptimConfig(lr=1e-2), tcfg, dtype=torch.float32)
        head = install(engine.model, chunk)
        assert (head is None) == (chunk == 0)
        x, losses = ids.to(engine.device), []
        for _ in range(steps):  # one batch, so the loss falls
            if head is not None:
                with head.armed(x):
                    loss = engine.module(input_ids=x, use_cache=False).logits
            else:
                loss = engine.module(input_ids=x, labels=x, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        out[chunk] = losses
    teardown()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chunked") / "model"
    tiny_olmo(tie=True, seed=4).save_pretrained(d)
    return str(d)


@pytest.mark.slow
@pytest.mark.parametrize("kind,world", [("plain", 1), ("fsdp", 2), ("deepspeed", 2)])
def test_every_engine_trains_the_same_with_the_chunked_loss(kind, world, model_dir):
    for rank in run_distributed(_engine_losses, world, kind, model_dir, init=False, timeout=300):
        full, chunked = rank[0], rank[5]
        assert len(full) == 3 and full[-1] < full[0]  # it trains
        assert chunked == pytest.approx(full, rel=1e-4, abs=1e-5)
