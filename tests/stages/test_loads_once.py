"""Pre-flight hands what it read to the work: a real stage-1 run and a real finetuning run read each tokenizer and
the P file once, and finetuning resolves its initial model once (counted at the one reader of each)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.finetune_fixtures import CTX, world  # noqa: F401 - the session fixture
from s2t2_dist.config import load_config


@pytest.fixture
def counted(monkeypatch):
    """Counters of every tokenizer-file read (data.tokenizers.read_tokenizer_file, by file), transformers
    tokenizer load (by model) and P-file read (by file) in this process, plus calls of the init resolver."""
    import s2t2_dist.translator.pfile as pfile
    import s2t2_dist.data.tokenizers as toks
    import s2t2_dist.stages.init_model as init_model

    counts = {"tokenizer_file": Counter(), "hf_tokenizer": Counter(), "p_file": Counter(), "resolve_plan": 0}

    def wrap(mod, name, key):
        real = getattr(mod, name)

        def counting(path, *a, **kw):
            if key == "resolve_plan":
                counts[key] += 1
            else:
                counts[key][str(Path(path).resolve())] += 1
            return real(path, *a, **kw)
        monkeypatch.setattr(mod, name, counting)

    wrap(toks, "read_tokenizer_file", "tokenizer_file")
    wrap(toks, "load_hf_tokenizer", "hf_tokenizer")
    wrap(pfile, "load_p", "p_file")
    wrap(init_model, "resolve_plan", "resolve_plan")
    return counts


def _file(d: Path) -> str:
    return str((d / "tokenizer.json").resolve())


def test_stage1_reads_each_tokenizer_and_the_p_file_once(world, tmp_path, counted):
    from s2t2_dist.stages.translate import TranslateConfig, run

    from s2t2_dist.translator.pfile import load_p

    p_file = world.p_file("sparse")
    ids = tmp_path / "source_ids.txt"  # the P file's source tokens, as an id file (read against the tokenizer)
    ids.write_text("".join(f"{i}\n" for i in load_p(p_file).source_ids.tolist()))
    counted["p_file"].clear()
    cfg = load_config(TranslateConfig, None, [
        f"run_dir={tmp_path / 'run'}", f"model.path={world.model_a}", f"data.train={world.new_train}",
        f"data.eval={world.new_eval}", f"data.tokenizer={world.tokenizer}", f"translator.init_p={p_file}",
        f"model.source_vocab={ids}", f"train.context_len={CTX}", "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2",
        "train.log_every=1", "train.ckpt_every=0", "train.eval_max_docs=4", "data.num_workers=0",
        "translator.heatmap=[8,8]"])
    summary = run(cfg, progress=False)
    assert summary["finished"] and Path(summary["p_file"]).is_file()
    assert counted["tokenizer_file"] == Counter({_file(world.tokenizer): 1, _file(world.model_a): 1})
    assert counted["hf_tokenizer"] == Counter({str(world.model_a.resolve()): 1})
    assert counted["p_file"] == Counter({str(p_file.resolve()): 1})


def test_finetune_reads_each_input_once_and_resolves_its_start_once(world, tmp_path, counted):
    from s2t2_dist.stages.finetune import FinetuneConfig, run

    p_file = world.p_file("softmax")
    cfg = load_config(FinetuneConfig, None, [
        f"run_dir={tmp_path}", f"model.path={world.model_a}", f"data.train={world.new_train}",
        f"data.eval={world.new_eval}", f"data.tokenizer={world.tokenizer}", f"init.p_file={p_file}",
        f"train.context_len={CTX}", "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2",
        "train.log_every=1", "train.ckpt_every=0", "train.eval_max_docs=4", "optim.lr=1e-2"])
    summary = run(cfg, progress=False)
    assert summary["finished"] and (tmp_path / "final" / "tokenizer.json").is_file()
    assert counted["resolve_plan"] == 1
    assert counted["tokenizer_file"] == Counter({_file(world.tokenizer): 1, _file(world.model_a): 1})
    assert counted["hf_tokenizer"] == Counter()  # the file's hash matches the P file's: no transformers tokenizer
    assert counted["p_file"] == Counter({str(p_file.resolve()): 1})


def test_evaluate_reads_each_input_once_and_resolves_its_start_once(world, tmp_path, counted):
    from s2t2_dist.stages.evaluate import EvaluateConfig, run

    p_file = world.p_file("sparse")
    cfg = load_config(EvaluateConfig, None, [
        f"run_dir={tmp_path}", f"model.path={world.model_a}", "init.kind=translated", f"init.p_file={p_file}",
        f"data.tokenizer={world.tokenizer}", f"data.eval={world.new_eval}", f"eval.context_len={CTX}",
        "eval.max_docs=4"])
    result = run(cfg, progress=False)
    assert result["metrics"]["docs"] == 4
    assert counted["resolve_plan"] == 1
    assert counted["tokenizer_file"] == Counter({_file(world.tokenizer): 1, _file(world.model_a): 1})
    assert counted["p_file"] == Counter({str(p_file.resolve()): 1})
