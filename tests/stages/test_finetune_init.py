"""Stage 2 in one process: the config and command lines, every initialisation through the one code path (translated
from sparse / softmax / unconstrained P files, new_tok_truncate, orig_tok), hash checks, and short plain-engine runs
of each init kind on real shards."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.finetune_fixtures import CTX, NEW_VOCAB, world  # noqa: F401 - the session fixture
from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.data.tokenizers import tokenizer_hash
from s2t2_dist.translator.pfile import load_p, save_p
from s2t2_dist.errors import PFileError
from s2t2_dist.engines.launcher import engine_overrides
from s2t2_dist.stages.finetune import FinetuneConfig, parse_config, run
from s2t2_dist.stages.init_model import InitConfig, check_shards, prepare_initial_model, resolve_plan
from s2t2_dist.errors import InitError


# ----------------------------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize("path", ["configs/finetune_olmo1b.yaml", "configs/finetune_olmo7b.yaml"])
def test_shipped_configs_have_the_paper_settings(path):
    cfg = load_config(FinetuneConfig, path)
    o, t = cfg.optim, cfg.train
    assert (o.lr, o.weight_decay, o.betas, o.eps, o.warmup_frac, o.final_lr_frac) == (2e-5, 0.01, [0.9, 0.95], 1e-5,
                                                                                      0.2, 0.1)
    assert (t.steps, t.batch_size, t.context_len, t.precision) == (2000, 16, 512, "auto")
    assert cfg.init.kind == "translated" and cfg.init.p_file and cfg.engine.kind == "deepspeed"
    d = FinetuneConfig()  # the dataclass defaults are the paper's too
    assert (d.optim.lr, d.optim.weight_decay, d.optim.eps) == (2e-5, 0.01, 1e-5)


def test_command_lines_of_both_launchers():
    # deepspeed launcher: --local_rank=N appended, --ds_config (or DeepSpeed's --deepspeed_config) selects the engine
    argv = ["--local_rank=1", "--deepspeed_config", "configs/ds_zero2.json", "--config", "configs/finetune_olmo1b.yaml"]
    cfg = parse_config(argv)
    assert cfg.engine.kind == "deepspeed" and cfg.engine.ds_config == "configs/ds_zero2.json"
    # torchrun: the same YAML, engine.kind=fsdp drops the YAML's DeepSpeed config
    cfg = parse_config(["--config", "configs/finetune_olmo7b.yaml", "engine.kind=fsdp", "train.steps=10"])
    assert cfg.engine.kind == "fsdp" and cfg.engine.ds_config is None and cfg.train.steps == 10
    assert "engine.ds_config=null" not in engine_overrides(["engine.kind=deepspeed"])
    with pytest.raises(ConfigError, match="p_file"):
        load_config(FinetuneConfig, "configs/finetune_olmo1b.yaml", ["init.p_file="])
    with pytest.raises(ConfigError, match="only used with init.kind=translated"):
        load_config(FinetuneConfig, "configs/finetune_olmo1b.yaml", ["init.kind=orig_tok"])
    with pytest.raises(ConfigError, match="init.kind"):
        load_config(FinetuneConfig, "configs/finetune_olmo1b.yaml", ["init.kind=random"])
    # finetuning's model section holds only what it reads (float32 master weights: no dtype key)
    for key in ("model.dtype=bfloat16", "model.activation_checkpointing=true", "model.source_vocab=all"):
        with pytest.raises(ConfigError, match=f"unknown config key '{key.split('=')[0]}'"):
            load_config(FinetuneConfig, "configs/finetune_olmo1b.yaml", [key])


# ----------------------------------------------------------------------------------------------------------------
# initialisations


def _load(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["sparse", "softmax", "unconstrained"])
def test_translated_init_is_the_translation_of_E_and_L(world, tmp_path, kind):
    """E' = (P / nu)^T E[src], L' likewise, in a new untied embedding/head of u rows; the rest of the model
    unchanged; the directory speaks the new tokenizer (hash kept) and its special ids; its logits are those of
    stage 1's TranslatedLM with the same E', L'."""
    from s2t2_dist.models.translated import TranslatedLM

    pf = world.p_file(kind)
    init = InitConfig(kind="translated", p_file=str(pf))
    plan = prepare_initial_model(init, str(world.model_a), str(world.tokenizer), tmp_path / "init", is_main=True)
    assert plan.p_kind == kind and plan.vocab_size == NEW_VOCAB and plan.model_dir == str(tmp_path / "init")
    src, new = _load(world.model_a), _load(tmp_path / "init")
    p = load_p(pf)
    P = p.dense(torch.float64)
    if kind == "sparse":
        assert p.values.numel() <= p.shape[0] + p.shape[1] - 1  # really sparse
    else:
        assert p.values.numel() == p.shape[0] * p.shape[1]
    W = P / p.nu.double()[None, :]  # the convex normalisation (unconstrained: W = C, of any sign)
    if kind == "unconstrained":
        assert (W < 0).any()
    E = src.get_input_embeddings().weight.double()
    L = src.get_output_embeddings().weight.double()
    E_new, L_new = new.get_input_embeddings().weight, new.get_output_embeddings().weight
    assert E_new.shape == (NEW_VOCAB, 32) and not new.config.tie_word_embeddings
    assert E_new.data_ptr() != L_new.data_ptr()
    torch.testing.assert_close(E_new.double(), W.T @ E[p.source_ids], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(L_new.double(), W.T @ L[p.source_ids], rtol=1e-5, atol=1e-6)
    body_src = {k: v for k, v in src.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    body_new = new.state_dict()
    assert all(torch.equal(v, body_new[k]) for k, v in body_src.items())
    assert new.config.vocab_size == NEW_VOCAB
    assert (new.config.bos_token_id, new.config.eos_token_id, new.config.pad_token_id) == (0, 1, 2)
    assert tokenizer_hash(tmp_path / "init") == tokenizer_hash(world.tokenizer)
    ids = torch.randint(0, NEW_VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = TranslatedLM(src)(ids, E_new.detach(), L_new.detach(), return_logits=True).logits
        torch.testing.assert_close(new(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
    # written once: a second preparation reuses the directory (a resumed run does not rewrite it)
    stamp = (tmp_path / "init" / "model.safetensors").stat().st_mtime_ns
    prepare_initial_model(init, str(world.model_a), str(world.tokenizer), tmp_path / "init", is_main=True)
    assert (tmp_path / "init" / "model.safetensors").stat().st_mtime_ns == stamp


def test_truncated_and_orig_tok_inits(world, tmp_path):
    plan = prepare_initial_model(InitConfig(kind="new_tok_truncate"), str(world.model_a), str(world.tokenizer),
                                 tmp_path / "trunc", is_main=True)
    src, new = _load(world.model_a), _load(tmp_path / "trunc")
    assert plan.vocab_size == NEW_VOCAB
    assert torch.equal(new.get_input_embeddings().weight, src.get_input_embeddings().weight[:NEW_VOCAB])
    assert torch.equal(new.get_output_embeddings().weight, src.get_output_embeddings().weight[:NEW_VOCAB])
    # orig_tok: the model as it is, its own tokenizer (u = 50,280 real tokens), nothing written
    plan = prepare_initial_model(InitConfig(kind="orig_tok"), str(world.model_a), "", tmp_path / "orig", is_main=True)
    assert plan.model_dir == str(world.model_a) and plan.vocab_size == 50280 and not (tmp_path / "orig").exists()
    from s2t2_dist.data.shards import load_manifest

    check_shards(load_manifest(world.src_train), plan, "data.train")
    with pytest.raises(InitError) as e:  # the new-tokenizer shards with the original model
        check_shards(load_manifest(world.new_train), plan, "data.train")
    assert plan.tokenizer_hash in str(e.value) and tokenizer_hash(world.tokenizer) in str(e.value)
    with pytest.raises(InitError, match="different tokenizer"):  # orig_tok with the new tokenizer named
        resolve_plan(InitConfig(kind="orig_tok"), str(world.model_a), str(world.tokenizer), tmp_path / "x")


def test_p_file_hash_mismatch_names_both_hashes(world, tmp_path):
    p = load_p(world.p_a)
    good_src, good_tgt = p.source_tokenizer_hash, p.target_tokenizer_hash
    p.source_tokenizer_hash = "0" * 64  # learned on a model with another tokenizer
    save_p(tmp_path / "bad_src.safetensors", p)
    init = InitConfig(kind="translated", p_file=str(tmp_path / "bad_src.safetensors"))
    with pytest.raises(PFileError) as e:
        resolve_plan(init, str(world.model_a), str(world.tokenizer), tmp_path / "init")
    assert "0" * 64 in str(e.value) and good_src in str(e.value) and "source" in str(e.value)
    p.source_tokenizer_hash, p.target_tokenizer_hash = good_src, "f" * 64  # for another new tokenizer
    save_p(tmp_path / "bad_tgt.safetensors", p)
    init = InitConfig(kind="translated", p_file=str(tmp_path / "bad_tgt.safetensors"))
    with pytest.raises(PFileError) as e:
        resolve_plan(init, str(world.model_a), str(world.tokenizer), tmp_path / "init")
    assert "f" * 64 in str(e.value) and good_tgt in str(e.value) and "target" in str(e.value)
    assert not (tmp_path / "init").exists()


# ----------------------------------------------------------------------------------------------------------------
# short runs of every init kind (plain engine, one process): one code path, the shared loop, the export


def _cfg(world, tmp_path, *extra):
    return load_config(FinetuneConfig, None, [
        f"run_dir={tmp_path}", f"model.path={world.model_a}", f"data.train={world.new_train}",
        f"data.eval={world.new_eval}", f"data.tokenizer={world.tokenizer}", f"train.context_len={CTX}",
        "train.steps=3", "train.batch_size=2", "train.micro_batch_size=2", "train.log_every=1", "train.ckpt_every=0",
        "train.eval_max_docs=8", "optim.lr=1e-2", *extra])


@pytest.mark.parametrize("kind", ["translated", "new_tok_truncate", "orig_tok"])
def test_each_init_kind_trains_evaluates_and_exports(world, tmp_path, kind):
    extra = {"translated": [f"init.p_file={world.p_file('softmax')}"],
             "new_tok_truncate": ["init.kind=new_tok_truncate"],
             "orig_tok": ["init.kind=orig_tok", f"data.train={world.src_train}", f"data.eval={world.src_eval}",
                          f"data.tokenizer={world.model_a}"]}[kind]
    summary = run(_cfg(world, tmp_path, *extra))
    losses = [l for _, l in summary["losses"]]
    assert summary["finished"] and len(losses) == 3 and losses[-1] < losses[0]
    u = 50280 if kind == "orig_tok" else NEW_VOCAB
    ev = summary["eval"]
    assert ev["docs"] == 8 and 0 < ev["bpb"] < 100
    assert ev["random_guess_nll_per_token"] == pytest.approx(torch.log(torch.tensor(float(u))).item())
    final = tmp_path / "final"
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["vocab_size"] == (50304 if kind == "orig_tok" else NEW_VOCAB)
    want = world.model_a if kind == "orig_tok" else world.tokenizer
    assert tokenizer_hash(final) == tokenizer_hash(want)
    assert json.loads((tmp_path / "result.json").read_text())["final_loss"] == losses[-1]


def test_embeddings_only_trains_the_new_rows_on_the_frozen_body(world, tmp_path):
    """trainable=embeddings (the P-only ceiling probe): from a translated start only E' and L' move; every other
    weight of the export is the start's bit for bit; the loss falls. Another engine is refused in one line."""
    from safetensors.torch import load_file

    summary = run(_cfg(world, tmp_path / "run", f"init.p_file={world.p_file('softmax')}", "trainable=embeddings"))
    losses = [l for _, l in summary["losses"]]
    assert summary["finished"] and losses[-1] < losses[0], losses
    start = load_file(str(tmp_path / "run" / "init" / "model.safetensors"))
    end = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    moved = sorted(k for k in start if not torch.equal(start[k], end[k]))
    assert moved == ["lm_head.weight", "model.embed_tokens.weight"], moved
    with pytest.raises(ConfigError, match="trainable=embeddings: needs engine.kind=plain"):
        run(_cfg(world, tmp_path / "fsdp", f"init.p_file={world.p_file('softmax')}", "trainable=embeddings",
                 "engine.kind=fsdp"))


def test_shards_of_the_wrong_tokenizer_are_refused(world, tmp_path):
    cfg = _cfg(world, tmp_path, "init.kind=new_tok_truncate", f"data.train={world.src_train}")
    with pytest.raises(ConfigError, match="data.train .* shards were tokenized with .* shards/new"):
        run(cfg)  # refused by the pre-flight check, before the initial model is written
    assert not (tmp_path / "init").exists()


def test_p_file_with_the_transformers_rebuilt_source_hash_is_accepted(world, tmp_path):
    """A model directory holding the hub's OLMo tokenizer.json (class GPTNeoXTokenizer): transformers rebuilds
    it, so `AutoTokenizer(...).backend_tokenizer` hashes differently from the file; a P file recording either is
    accepted, anything else is an error naming the P file's hash and the model's."""
    import shutil

    from tests.helpers.finetune_fixtures import SHARED
    from s2t2_dist.data.tokenizers import transformers_tokenizer_hash

    d = tmp_path / "hubtok_model"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(world.model_a / f, d / f)
    shutil.copyfile(SHARED / "olmo" / "allenai_gpt-neox-olmo-dolma-v1_5.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTNeoXTokenizer", "bos_token": None,
                                                         "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"}))
    file_hash, rebuilt = tokenizer_hash(d), transformers_tokenizer_hash(str(d))
    p = load_p(world.p_a)
    for h in (file_hash, rebuilt):
        p.source_tokenizer_hash = h
        save_p(tmp_path / "p.safetensors", p)
        plan, _ = resolve_plan(InitConfig(kind="translated", p_file=str(tmp_path / "p.safetensors")), str(d),
                               str(world.tokenizer), tmp_path / "init")
        assert plan.source_tokenizer_hash == h
    p.source_tokenizer_hash = tokenizer_hash(world.model_a)  # the re-saved tokenizer's file: another hash
    if p.source_tokenizer_hash not in (file_hash, rebuilt):
        save_p(tmp_path / "p.safetensors", p)
        with pytest.raises(PFileError) as e:
            resolve_plan(InitConfig(kind="translated", p_file=str(tmp_path / "p.safetensors")), str(d),
                         str(world.tokenizer), tmp_path / "init")
        assert p.source_tokenizer_hash in str(e.value) and file_hash in str(e.value)


def test_a_foreign_directory_is_never_replaced(world, tmp_path):
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(InitError, match="not written by s2t2"):
        prepare_initial_model(InitConfig(kind="new_tok_truncate"), str(world.model_a), str(world.tokenizer), mine,
                              is_main=True)
    assert (mine / "notes.txt").read_text() == "keep me"
