"""Any Hugging Face causal LM: tiny random models of eight architectures (built here from transformers' own config
classes, no downloads), tied and untied heads, through translate (P only), finetune and export; plain
`AutoModelForCausalLM.from_pretrained` of the export reproduces the trained model's logits. An architecture S2T2
cannot translate is refused with one line (exit 2).

The source tokenizer of every tiny model is a small BPE trained on the test's proteins (64 tokens); the models have
72 embedding rows, so padding rows exist and must never become source tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.arch_fixtures import ARCHS, CTX, D, ROWS, prepare_arch_data, save_model

from s2t2_dist.config import load_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_arch_data(tmp_path_factory.mktemp("arch_data"))


def _common(run_dir, data, model):
    return [f"run_dir={run_dir}", f"model.path={model}", f"data.train={data}/shards/new/train", "data.eval=",
            f"data.tokenizer={data}/tokenizer", f"train.context_len={CTX}", "train.batch_size=2",
            "train.micro_batch_size=2", "train.log_every=1", "train.ckpt_every=0"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_translate_finetune_export_reload(data, tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM

    from s2t2_dist.models.hf import get_embedding_and_head
    from s2t2_dist.models.translated import TranslatedLM
    from s2t2_dist.translator.pfile import load_p
    from s2t2_dist.stages import finetune, translate

    model_dir = tmp_path / "model"
    save_model(model_dir, arch, tied, data / "tokenizer")
    src = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    E, L, is_tied = get_embedding_and_head(src)
    assert is_tied is tied and E.shape == (ROWS, D)
    # Reading through the model's own E and L, the translated path is the model itself (Gemma's sqrt(d) included)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        through = TranslatedLM(src)(ids, E_new=E, L_new=L, return_logits=True).logits
        torch.testing.assert_close(through, src(ids).logits, atol=1e-5, rtol=1e-5)

    cfg = load_config(translate.TranslateConfig, None,
                      _common(tmp_path / "tr", data, model_dir) + ["train.steps=3"])
    summary = translate.run(cfg)
    assert summary["finished"]
    p = load_p(summary["p_file"])
    assert p.source_ids.tolist() == list(range(64))  # the real tokens only, never the 8 padding rows

    cfg = load_config(finetune.FinetuneConfig, None,
                      _common(tmp_path / "ft", data, model_dir)
                      + ["train.steps=2", "optim.lr=1e-2", f"init.p_file={summary['p_file']}", "engine.kind=plain"])
    fs = finetune.run(cfg)
    assert fs["finished"] and all(torch.isfinite(torch.tensor(l)) for _, l in fs["losses"])
    final = tmp_path / "ft" / "final"
    exported = json.loads((final / "config.json").read_text())
    assert exported["vocab_size"] == 64 and exported["tie_word_embeddings"] is False
    probe = torch.load(tmp_path / "ft" / "export_probe.pt", weights_only=True)
    reloaded = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    assert type(reloaded) is type(src) and type(reloaded.get_input_embeddings()) is type(src.get_input_embeddings())
    with torch.no_grad():
        logits = reloaded(probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=1e-5)
    # and finetuning moved the model away from its translated start (the probe is of the TRAINED model)
    init = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft" / "init")).eval()
    with torch.no_grad():
        assert not torch.allclose(init(probe["input_ids"]).logits, logits, atol=1e-4)


def test_unsupported_architecture_is_one_line_exit_2(data, tmp_path, capsys):
    """GPT-J's output head has a bias: S2T2 (E' = W^T E, L' = W^T L) has no translation for it."""
    import transformers as T

    from s2t2_dist.stages import translate

    cfg = T.GPTJConfig(vocab_size=ROWS, n_embd=D, n_layer=1, n_head=4, rotary_dim=4, n_positions=64,
                       bos_token_id=None, eos_token_id=None)
    model_dir = tmp_path / "gptj"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(model_dir))
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, model_dir / f.name)
    capsys.readouterr()
    rc = translate.main(_common(tmp_path / "tr", data, model_dir) + ["train.steps=1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]  # minus progress bars
    assert rc == 2
    assert err == [f"s2t2 translate: error: UnsupportedModel: model.path={model_dir}: GPTJForCausalLM's output head "
                   "has a bias; S2T2 translates the head's weights only (L' = W^T L) and has no translation for a "
                   "per-token bias"], err
