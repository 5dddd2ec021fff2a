"""Evaluation: BpB by hand for a uniform model, batched scoring against the reference scorer, a source model + P
against stage 1's TranslatedLM, transfer between models of different widths, hash mismatches, the JSON and
TensorBoard outputs, and lock-step forward calls across 2 gloo processes with uneven shares."""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.ft_lockstep_worker import rank_main
from tests.helpers.finetune_fixtures import CTX, NEW_VOCAB, world  # noqa: F401 - the session fixture
from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.data.reader import EvalDocs
from s2t2_dist.data.shards import load_manifest
from s2t2_dist.eval.bpb import EvalTotals, score_documents
from s2t2_dist.eval.scoring import DocScores, hf_logits_fn, score_documents_batched
from s2t2_dist.translator.pfile import load_p, save_p
from s2t2_dist.errors import PFileError
from s2t2_dist.stages.evaluate import EvaluateConfig, run


def _eval(tmp_path, *overrides):
    cfg = load_config(EvaluateConfig, None, [f"run_dir={tmp_path}", f"eval.context_len={CTX}", *overrides])
    return run(cfg)


def _uniform_model(world, out):
    """The new-tokenizer model with a zero LM head: every prediction is uniform over the u tokens."""
    from transformers import AutoModelForCausalLM

    from s2t2_dist.stages.init_model import InitConfig, prepare_initial_model
    from s2t2_dist.data.tokenizers import copy_tokenizer_files, load_tokenizer

    prepare_initial_model(InitConfig(kind="new_tok_truncate"), str(world.model_a), str(world.tokenizer),
                          out.parent / "trunc", is_main=True)
    m = AutoModelForCausalLM.from_pretrained(str(out.parent / "trunc"), dtype=torch.float32)
    with torch.no_grad():
        m.get_output_embeddings().weight.zero_()
    m.save_pretrained(str(out))
    copy_tokenizer_files(load_tokenizer(str(world.tokenizer)), out)
    return out


@pytest.mark.parametrize("batch", [1, 5])
def test_uniform_model_bpb_by_hand(world, tmp_path, batch):
    """Tokenizer-independent hand value: uniform logits cost ln(u) nats per token, so
    BpB = ln(u) * tokens / (ln 2 * bytes) with the shards' own token and byte counts, and perplexity = u."""
    model = _uniform_model(world, tmp_path / "uniform")
    r = _eval(tmp_path / "run", f"model.path={model}", f"data.eval={world.new_eval}", f"eval.batch_size={batch}",
              "eval.name=uniform")
    totals = load_manifest(world.new_eval)["totals"]
    m = r["metrics"]
    assert (m["tokens"], m["bytes"], m["docs"]) == (totals["n_tokens"], totals["text_bytes"], totals["n_docs"])
    hand = math.log(NEW_VOCAB) * totals["n_tokens"] / (math.log(2) * totals["text_bytes"])
    assert m["bpb"] == pytest.approx(hand, rel=1e-6)  # float32 log-softmax of zeros
    assert m["perplexity"] == pytest.approx(NEW_VOCAB, rel=1e-6)
    assert m["random_guess_bpb"] == pytest.approx(hand, rel=1e-12)
    assert m["random_guess_nll_per_token"] == pytest.approx(math.log(NEW_VOCAB))
    # the JSON (atomic write, no temporary left) and the TensorBoard scalars
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert saved["metrics"] == m and saved["name"] == "uniform" and saved["init"]["vocab_size"] == NEW_VOCAB
    # each document's own scores: every document once, summing to the totals, each at ln(u) a token
    d = saved["documents"]
    assert d["index"] == sorted(set(d["index"])) and len(d["index"]) == int(m["docs"])
    assert (sum(d["tokens"]), sum(d["bytes"])) == (int(m["tokens"]), int(m["bytes"]))
    assert sum(d["nll_nats"]) == pytest.approx(saved["totals"]["nll_nats"], rel=1e-12)
    assert all(x == pytest.approx(math.log(NEW_VOCAB) * t, rel=1e-5) for x, t in zip(d["nll_nats"], d["tokens"]))
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb" / "global"))
    acc.Reload()
    assert acc.Scalars("eval/uniform/bpb")[0].value == pytest.approx(m["bpb"], rel=1e-6)
    assert "eval/uniform/random_guess_bpb" in acc.Tags()["scalars"]


def test_batched_scoring_equals_the_reference_scorer(world):
    """Several right-padded windows per forward (and short contexts, so documents roll over several windows) give
    the per-window reference scorer's sums."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(world.model_b), dtype=torch.float32).eval()
    fn = hf_logits_fn(model, torch.device("cpu"))
    docs = list(EvalDocs(world.src_eval))[:6]
    ref = score_documents(fn, docs, context_len=16)
    for bs in (1, 4):
        got = score_documents_batched(fn, docs, 16, batch_size=bs, pad_id=1)
        assert (got.tokens, got.bytes, got.docs) == (ref.tokens, ref.bytes, ref.docs)
        assert got.nll_nats == pytest.approx(ref.nll_nats, rel=1e-6)
    assert score_documents_batched(fn, docs, 16, batch_size=4, max_docs=3).docs == 3
    # each document's own scores, batched with the others, are the reference scorer's for it alone
    per_doc = DocScores.empty()
    score_documents_batched(fn, docs, 16, batch_size=4, pad_id=1, per_doc=per_doc)
    for doc in docs:
        alone = score_documents(fn, [doc], context_len=16)
        i = int(doc["index"])
        assert (per_doc.tokens[i], per_doc.bytes[i]) == (alone.tokens, alone.bytes)
        assert per_doc.nll_nats[i] == pytest.approx(alone.nll_nats, rel=1e-6)


def test_translated_without_finetuning_matches_stage1_forward(world, tmp_path):
    """(b) source model + P: the evaluation equals scoring stage 1's TranslatedLM with E', L' from the P file."""
    from s2t2_dist.models.translated import TranslatedLM
    from s2t2_dist.stages.init_model import translated_embeddings
    from transformers import AutoModelForCausalLM

    r = _eval(tmp_path, f"model.path={world.model_a}", "init.kind=translated", f"init.p_file={world.p_a}",
              f"data.tokenizer={world.tokenizer}", f"data.eval={world.new_eval}", "eval.max_docs=10")
    src = AutoModelForCausalLM.from_pretrained(str(world.model_a), dtype=torch.float32).eval()
    E_new, L_new = translated_embeddings(src, load_p(world.p_a))
    fn = TranslatedLM(src).logits_fn(E_new, L_new)
    docs = [d for d in EvalDocs(world.new_eval) if d["index"] < 10]
    ref = score_documents(fn, docs, CTX).metrics(NEW_VOCAB)
    assert r["metrics"]["docs"] == 10
    assert r["metrics"]["bpb"] == pytest.approx(ref["bpb"], rel=1e-5)
    assert r["p_file"] == str(world.p_a) and r["init"]["p_kind"] == "sparse"


def test_transfer_to_a_wider_model(world, tmp_path):
    """(c) the P learned on model A (width 32, tied) applied to model B (width 48, untied, same vocabulary)."""
    r = _eval(tmp_path, f"model.path={world.model_b}", "init.kind=translated", f"init.p_file={world.p_a}",
              f"data.tokenizer={world.tokenizer}", f"data.eval={world.new_eval}", "eval.name=transfer")
    m = r["metrics"]
    assert all(math.isfinite(m[k]) for k in ("bpb", "perplexity", "nll_per_token")) and m["docs"] == 29
    assert m["random_guess_nll_per_token"] == pytest.approx(math.log(NEW_VOCAB))
    import safetensors.torch as st

    w = st.load_file(str(tmp_path / "init" / "model.safetensors"))
    assert w["model.embed_tokens.weight"].shape == (NEW_VOCAB, 48)
    # and the baselines of the same figure through the same code path
    orig = _eval(tmp_path / "orig", f"model.path={world.model_b}", "init.kind=orig_tok", f"data.eval={world.src_eval}")
    assert orig["metrics"]["bytes"] == m["bytes"]  # the same bytes whatever the tokenizer
    assert orig["metrics"]["random_guess_nll_per_token"] == pytest.approx(math.log(50280))


def test_transfer_refuses_a_model_with_another_source_tokenizer(world, tmp_path):
    p = load_p(world.p_a)
    theirs = p.source_tokenizer_hash
    p.source_tokenizer_hash = "a1" * 32  # a P learned on a model with another tokenizer
    save_p(tmp_path / "P_other.safetensors", p)
    with pytest.raises(PFileError) as e:
        _eval(tmp_path, f"model.path={world.model_b}", "init.kind=translated",
              f"init.p_file={tmp_path / 'P_other.safetensors'}", f"data.tokenizer={world.tokenizer}",
              f"data.eval={world.new_eval}")
    assert "a1" * 32 in str(e.value) and theirs in str(e.value)
    # the source shards for a new-vocab model: refused by the pre-flight check, before the model is built
    with pytest.raises(ConfigError, match="data.eval .* shards were tokenized with"):
        _eval(tmp_path / "x", f"model.path={world.model_b}", "init.kind=translated", f"init.p_file={world.p_a}",
              f"data.tokenizer={world.tokenizer}", f"data.eval={world.src_eval}")


# ----------------------------------------------------------------------------------------------------------------
# lock-step forward calls over 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lockstep_forward_calls_and_exact_sums():
    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(0, 8, (n,), generator=g), "n_bytes": 2 * n, "index": i}
            for i, n in enumerate([3, 9, 12, 5, 7])]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, docs, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (_, c0, t0), (_, c1, t1) = res
    assert c0 == c1 > 1  # rank 0 ran out after one batch and made dummy calls
    torch.manual_seed(0)
    head = torch.randn(8, 8)
    ref = score_documents(lambda ids: head[ids] * 0.5, docs, context_len=3)
    assert t0 == t1
    assert t0["tokens"] == ref.tokens and t0["bytes"] == ref.bytes and t0["docs"] == 5
    assert t0["nll_nats"] == pytest.approx(ref.nll_nats, rel=1e-12)
    assert isinstance(EvalTotals(**t0).metrics(8)["bpb"], float)


def test_a_model_computing_non_finite_logits_gives_no_score(world, tmp_path):
    """Damaged weights that still parse (here: a weight matrix of NaN) were scored: exit 0 and `perplexity nan, bpb
    nan` in eval.json. Now one line naming the model, and no eval.json."""
    from safetensors.torch import load_file, save_file

    from s2t2_dist.errors import ModelLoadError

    model = _uniform_model(world, tmp_path / "nan")
    sd = load_file(str(model / "model.safetensors"))
    first = sorted(k for k in sd if sd[k].dim() == 2)[0]
    sd[first].fill_(float("nan"))
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"model.path {model}: the total loss over [\d,]+ tokens is nan .*no "
                                             "score was written"):
        _eval(tmp_path / "run", f"model.path={model}", f"data.eval={world.new_eval}")
    assert not (tmp_path / "run" / "eval.json").exists()
