"""Every stage validates before it works and reports a user error as one line with exit 2.

Real inputs: protein shards prepared from a real FASTA file, the shipped stories260K model; the stages are called
through their command-line entry points (`main(argv)`), as `s2t2 <stage>` calls them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers.stage_fixtures import REPO, prepare_small, small_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    a, model = small_inputs(tmp_path_factory)  # (vocabulary 96)
    b = prepare_small(tmp_path_factory.mktemp("validation_inputs") / "b", vocab_size=80)
    return a, b, model


def _one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert rc == 2, err[-3000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _translate_args(run_dir, model, train, tokenizer, *extra):
    return ["--config", str(REPO / "configs" / "translate_olmo1b.yaml"), f"run_dir={run_dir}",
            f"model.path={model}", "model.source_vocab=all", f"data.train={train}", f"data.tokenizer={tokenizer}",
            "train.context_len=64", "train.batch_size=2", "train.micro_batch_size=2", "train.log_every=1",
            "train.ckpt_every=2", "translator.heatmap=[8,8]", "data.eval=", *extra]


# -- 1. translate checks the shards against data.tokenizer ------------------------------------------------------


@pytest.mark.parametrize("direction", ["smaller_tokenizer", "larger_tokenizer"])
def test_translate_refuses_shards_of_another_tokenizer(inputs, tmp_path, capsys, direction):
    from s2t2_dist.stages import translate

    a, b, model = inputs
    shards, tok = (a, b) if direction == "smaller_tokenizer" else (b, a)
    rc = translate.main(_translate_args(tmp_path / "run", model, shards / "shards/new/train", tok / "tokenizer",
                                        "train.steps=2"))
    line = _one_line_error(capsys, rc)
    assert "data.train" in line and "data.tokenizer" in line and "hash" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "P.safetensors").exists()


def test_translate_refuses_eval_shards_of_another_tokenizer(inputs, tmp_path, capsys):
    from s2t2_dist.stages import translate

    a, b, model = inputs
    rc = translate.main(_translate_args(tmp_path / "run", model, a / "shards/new/train", a / "tokenizer",
                                        f"data.eval={b}/shards/new/eval", "train.steps=2"))
    line = _one_line_error(capsys, rc)
    assert "data.eval" in line, line


# -- 2. prepare never replaces the tokenizer of another job -------------------------------------------------------


def test_prepare_rerun_with_another_vocab_size_keeps_everything(inputs, tmp_path, capsys):
    from s2t2_dist.stages import prepare as prepare_stage

    out = tmp_path / "data"
    shutil.copytree(inputs[0], out)
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    from tests.helpers.stage_fixtures import protein_fasta

    rc = prepare_stage.main([f"inputs=[{protein_fasta()}]", "eval_fraction=0.05", "vocab_size=80", "context_len=64",
                             "shard_size=64", f"output_dir={out}", "extra_residue_policy=keep", "--no-progress"])
    line = _one_line_error(capsys, rc)
    assert "tokenizer" in line and "vocab_size" in line, line
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert {p: after.get(p) for p in before} == before  # (the run lock and marker are added: bookkeeping)


# -- 3. the documented `slurm:` section of a stage YAML ---------------------------------------------------------


def test_stage_yaml_with_slurm_section_is_accepted(tmp_path):
    from s2t2_dist.config import load_config
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.stages.translate import TranslateConfig

    cfg = yaml.safe_load((REPO / "configs" / "translate_olmo1b.yaml").read_text())
    cfg["slurm"] = {"nodes": 2, "gpus_per_node": 8, "time": "8:00:00", "partition": "a100"}
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(cfg))
    loaded = load_config(TranslateConfig, f, ["data.train=x", "data.tokenizer=y", "model.path=m"])
    assert loaded.model.path == "m"
    # its keys are `s2t2 submit`'s to check (test_submit_validates_...); the stage only needs a mapping
    cfg["slurm"] = "two nodes"
    f.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="slurm: expected a mapping"):
        load_config(TranslateConfig, f, ["data.train=x", "data.tokenizer=y", "model.path=m"])


def test_submit_validates_the_stage_config_before_queueing(inputs, tmp_path, capsys, monkeypatch):
    """`s2t2 submit` reads the slurm: section, checks the stage's own config (which carries that section) and
    refuses a bad one with one line, before anything is queued."""
    from s2t2_dist.cluster import submit

    cfg = yaml.safe_load((REPO / "configs" / "translate_olmo1b.yaml").read_text())
    cfg["slurm"] = {"nodes": 1, "tasks_per_node": 1, "time": "0:05:00", "folder": str(tmp_path / "sub")}
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(cfg))
    queued = []
    monkeypatch.setattr(submit, "submit_stage", lambda *a, **k: queued.append(a) or pytest.fail("queued"))
    rc = submit.main(["translate", "--config", str(f), "train.stepz=3", "--cluster", "local"])
    line = _one_line_error(capsys, rc)
    assert "train.stepz" in line and not queued, line
    # the same file with a valid stage config is accepted and its slurm: section used
    monkeypatch.setattr(submit, "submit_stage", lambda stage, argv, c, cluster=None: queued.append((stage, argv, c))
                        or (_ for _ in ()).throw(SystemExit(0)))
    a, _, model = inputs
    with pytest.raises(SystemExit):
        submit.main(["translate", "--config", str(f), f"model.path={model}", f"data.train={a}/shards/new/train",
                     f"data.tokenizer={a}/tokenizer", "--cluster", "local"])
    assert queued and queued[0][2].time == "0:05:00"
    # a mistyped key in the YAML's slurm: section is submit's to refuse, before queueing
    cfg["slurm"]["nodez"] = 2
    f.write_text(yaml.safe_dump(cfg))
    queued.clear()
    line = _one_line_error(capsys, submit.main(["translate", "--config", str(f), "--cluster", "local"]))
    assert "slurm.nodez" in line and not queued, line


def test_stage_run_directly_with_slurm_section(inputs, tmp_path, capsys):
    from s2t2_dist.stages import translate

    a, _, model = inputs
    cfg = yaml.safe_load((REPO / "configs" / "translate_olmo1b.yaml").read_text())
    cfg["slurm"] = {"nodes": 1, "time": "10"}
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(cfg))
    args = _translate_args(tmp_path / "run", model, a / "shards/new/train", a / "tokenizer", "train.steps=2")
    args[1] = str(f)
    assert translate.main(args) == 0, capsys.readouterr().err[-3000:]


# -- 4. resume with changed optimiser settings; re-running a finished run ----------------------------------------


def test_resume_with_changed_optimiser_is_refused_and_config_yaml_kept(inputs, tmp_path, capsys):
    from s2t2_dist.stages import translate

    a, _, model = inputs
    run = tmp_path / "run"
    base = _translate_args(run, model, a / "shards/new/train", a / "tokenizer", "train.steps=4")
    assert translate.main([*base, "train.stop_after=2", "optim.lr=0.01"]) == 0
    recorded = (run / "config.yaml").read_text()
    rc = translate.main([*base, "optim.lr=0.5"])
    line = _one_line_error(capsys, rc)
    assert "optim" in line and "lr" in line, line
    assert (run / "config.yaml").read_text() == recorded  # the recorded config is the one the checkpoint used
    assert translate.main([*base, "optim.lr=0.01"]) == 0


def test_rerunning_a_finished_run_keeps_final_loss(inputs, tmp_path):
    from s2t2_dist.stages import translate

    a, _, model = inputs
    run = tmp_path / "run"
    args = _translate_args(run, model, a / "shards/new/train", a / "tokenizer", "train.steps=2")
    assert translate.main(args) == 0
    first = json.loads((run / "result.json").read_text())
    assert first["final_loss"] is not None
    assert translate.main(args) == 0
    again = json.loads((run / "result.json").read_text())
    assert again["final_loss"] == first["final_loss"] and again["step"] == 2


# -- 5. evaluate reports user errors in one line; empty eval split before training --------------------------------


def test_evaluate_user_errors_are_one_line(inputs, tmp_path, capsys):
    from s2t2_dist.stages import evaluate

    a, _, model = inputs
    base = [f"run_dir={tmp_path / 'ev'}", f"data.eval={a}/shards/new/eval", "eval.context_len=64"]
    rc = evaluate.main([*base, f"model.path={tmp_path / 'nope'}"])
    line = _one_line_error(capsys, rc)
    assert "model.path" in line and "nope" in line, line
    empty = tmp_path / "empty_model"
    empty.mkdir()
    rc = evaluate.main([*base, f"model.path={empty}"])
    line = _one_line_error(capsys, rc)
    assert "config.json" in line, line
    # a source model whose tokenizer has more tokens than the model has embedding rows
    bad = tmp_path / "bad_model"
    shutil.copytree(model, bad)
    shutil.copy(a / "tokenizer" / "tokenizer.json", bad / "tokenizer.json")
    cfgj = json.loads((bad / "config.json").read_text())
    cfgj["vocab_size"] = 64
    (bad / "config.json").write_text(json.dumps(cfgj))
    from safetensors.torch import load_file, save_file  # weights of 64 rows too: config.json agrees

    sd = load_file(str(bad / "model.safetensors"))
    save_file({k: v[:64].clone() if ("embed" in k or "lm_head" in k) and v.dim() == 2 else v for k, v in sd.items()},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    rc = evaluate.main([*base, f"model.path={bad}", f"data.eval={a}/shards/new/eval"])
    line = _one_line_error(capsys, rc)
    assert "embedding rows" in line or "tokens" in line, line


def test_empty_eval_split_is_refused_before_training(inputs, tmp_path, capsys):
    from s2t2_dist.data.shards import load_manifest
    from s2t2_dist.stages import translate

    a, _, model = inputs
    ev = tmp_path / "eval"
    shutil.copytree(a / "shards/new/eval", ev)
    m = json.loads((ev / "manifest.json").read_text())
    for s in m["shards"]:
        (ev / s["name"]).unlink()
    m["shards"] = []
    for k in m["totals"]:
        m["totals"][k] = 0
    (ev / "manifest.json").write_text(json.dumps(m))
    load_manifest(ev)  # a well-formed manifest of zero documents
    rc = translate.main(_translate_args(tmp_path / "run", model, a / "shards/new/train", a / "tokenizer",
                                        f"data.eval={ev}", "train.steps=2", "train.eval_every=1"))
    line = _one_line_error(capsys, rc)
    assert "data.eval" in line and "no documents" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- data that is almost certainly wrong: warnings in the summary ------------------------------------------------


def _fasta(tmp_path, name, n=120, edit=None, double=False):
    from tests.helpers.stage_fixtures import protein_fasta

    lines, recs = [], 0
    for line in protein_fasta().read_text().splitlines():
        recs += line.startswith(">")
        if recs > n:
            break
        lines.append(edit(recs, line) if edit and not line.startswith(">") else line)
    text = "\n".join(lines) + "\n"
    if double:
        text += text.replace(">", ">copy_")
    f = tmp_path / f"{name}.fasta"
    f.write_text(text)
    return f


def _warnings(tmp_path, fasta, **kw):
    from s2t2_dist.data.config import DataConfig
    from s2t2_dist.data.pipeline import prepare

    cfg = DataConfig(inputs=[str(fasta)], output_dir=str(tmp_path / fasta.stem), context_len=64, shard_size=64,
                     **{"vocab_size": 40, "eval_fraction": 0.2, **kw})
    return prepare(cfg, progress=False)["warnings"]


def test_prepare_warns_about_almost_certainly_wrong_data(tmp_path):
    clean = _warnings(tmp_path, _fasta(tmp_path, "clean"))
    assert clean == [], clean
    w = _warnings(tmp_path, _fasta(tmp_path, "dups", double=True))
    assert any("same text as an eval record" in x for x in w), w
    w = _warnings(tmp_path, _fasta(tmp_path, "all_x", edit=lambda i, s: "X" * len(s)))
    assert any("not among the 20 standard amino acids" in x for x in w), w
    w = _warnings(tmp_path, _fasta(tmp_path, "junk", edit=lambda i, s: s if i % 4 == 0 else "1" * len(s)),
                  on_bad_record="skip")
    assert any("were skipped or filtered (bad_character" in x for x in w), w
    w = _warnings(tmp_path, _fasta(tmp_path, "big_vocab"), vocab_size=50_000)
    assert any("fewer than vocab_size=50000" in x for x in w), w
    w = _warnings(tmp_path, _fasta(tmp_path, "tiny_eval", n=30), eval_fraction=0.05)
    assert any("eval split" in x for x in w), w


def test_translate_preflight_refusals_name_the_key(inputs, tmp_path, capsys):
    from s2t2_dist.stages import translate

    a, b, model = inputs
    base = _translate_args(tmp_path / "run", model, a / "shards/new/train", a / "tokenizer", "train.steps=2")
    cases = {
        "train.context_len=4096": "longer than the",  # the model's positions (stories260K: 512)
        f"translator.init_p={tmp_path / 'none.safetensors'}": "translator.init_p",
        "train.batch_size=3": "not a multiple",
        f"data.train={a}/shards/new/eval": "needs a train split",
        f"model.path={a}/tokenizer": "no config.json",
    }
    for override, expect in cases.items():
        rc = translate.main([*base, override])
        line = _one_line_error(capsys, rc)
        assert expect in line, (override, line)
    (tmp_path / "file").write_text("x")
    line = _one_line_error(capsys, translate.main([*base, f"run_dir={tmp_path / 'file'}"]))
    assert "run_dir" in line and "not a directory" in line
    assert not (tmp_path / "run").exists()  # nothing was written by any refused run


def test_prepare_after_fixing_a_bad_input_continues_in_the_same_output_dir(tmp_path, capsys):
    """The first run stops at the bad line having committed nothing; once the file is fixed the same command
    works (before: 'a half-finished split with different parameters' until the directory was deleted)."""
    from s2t2_dist.stages import prepare as prepare_stage

    good = _fasta(tmp_path, "input", n=40)
    text = good.read_text()
    lines = text.splitlines()
    lines[1] = lines[1][:5] + "123" + lines[1][8:]
    good.write_text("\n".join(lines) + "\n")
    args = [f"inputs=[{good}]", f"output_dir={tmp_path / 'out'}", "vocab_size=40", "context_len=64",
            "shard_size=64", "eval_fraction=0.2", "--no-progress"]
    line = _one_line_error(capsys, prepare_stage.main(args))
    assert "input.fasta:2" in line, line
    good.write_text(text + ">extra\nMKV\n")  # fixed (another size: the split parameters changed)
    assert prepare_stage.main(args) == 0, capsys.readouterr().err[-2000:]


# -- nothing lost, nothing silent (locks, literal values, checked values) ------------------------------


def test_command_line_values_of_string_keys_are_taken_literally():
    from s2t2_dist.config import load_config
    from s2t2_dist.stages.translate import TranslateConfig

    need = ["model.path=m", "data.train=t", "data.tokenizer=k"]
    for raw in ("runs/exp #2", "0010", "2024_01_05", "0x1F", "1e3", "true", "null"):
        cfg = load_config(TranslateConfig, None, [f"run_dir={raw}", *need])
        assert cfg.run_dir == raw  # before: 'runs/exp', '8', '20240105', '31', '1000.0', 'True', ...
    cfg = load_config(TranslateConfig, None, ["train.steps=0x10", "optim.lr=1e-3", "translator.heatmap=[4,8]",
                                              "train.keep_checkpoints=3", *need])
    assert (cfg.train.steps, cfg.optim.lr, cfg.translator.heatmap, cfg.train.keep_checkpoints) == (16, 1e-3, [4, 8], 3)


@pytest.mark.parametrize("text,line,key", [("run_dir: a\nrun_dir: b\n", 2, "run_dir"),
                                           ("train:\n  steps: 3\nmodel:\n  path: x\ntrain:\n  steps: 4\n", 5, "train"),
                                           ("train:\n  steps: 3\n  seed: 1\n  steps: 4\n", 4, "steps")])
def test_duplicate_yaml_keys_and_sections_are_refused_naming_file_and_line(tmp_path, text, line, key):
    from s2t2_dist.config import load_config
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.stages.translate import TranslateConfig

    f = tmp_path / "dup.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{f}:{line}: key '{key}' given twice"):
        load_config(TranslateConfig, f, validate=False)


def test_config_not_utf8_is_one_line_and_a_bom_is_accepted(tmp_path):
    from s2t2_dist.config import read_yaml
    from s2t2_dist.errors import ConfigError

    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"model:\n  path: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{f}:2: not UTF-8 text \(byte 0xe9\)"):
        read_yaml(f)
    f.write_bytes(b"\xef\xbb\xbfrun_dir: x\n")
    assert read_yaml(f) == {"run_dir": "x"}


@pytest.mark.parametrize("override,match", [("optim.lr=nan", "optim.lr: expected a finite number"),
                                            ("optim.lr=inf", "optim.lr: expected a finite number"),
                                            ("optim.lr=-1", "lr: must be > 0"),
                                            ("train.keep_checkpoints=0", "keep_checkpoints: must be >= 1"),
                                            ("train.keep_checkpoints=-2", "keep_checkpoints: must be >= 1")])
def test_learning_rates_finite_and_keep_checkpoints_at_least_one(override, match):
    from s2t2_dist.config import load_config
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.stages.translate import TranslateConfig

    with pytest.raises(ConfigError, match=match):
        load_config(TranslateConfig, None, [override, "model.path=m", "data.train=t", "data.tokenizer=k"])


def _p_file(path, values=None, meta=None, kind="sparse"):
    import torch
    from safetensors.torch import save_file

    from s2t2_dist.translator.pfile import FORMAT

    v, u = 3, 4
    mu, nu = torch.full((v,), 1 / v), torch.full((u,), 1 / u)
    P = mu[:, None] * nu[None, :]  # the independent plan: exact marginals
    idx = P.nonzero().T.contiguous()
    vals = P[idx[0], idx[1]] if values is None else values(P[idx[0], idx[1]])
    m = {"format": FORMAT, "shape": json.dumps([v, u]), "source_tokenizer_hash": "s", "target_tokenizer_hash": "t",
         "kind": kind, "normalization": "convex", **(meta or {})}
    save_file({"indices": idx, "values": vals.contiguous(), "mu": mu, "nu": nu, "source_ids": torch.arange(v)},
              str(path), metadata={k: x for k, x in m.items() if x is not None})
    return path


@pytest.mark.parametrize("values,meta,match", [
    (lambda x: x * float("nan"), None, "12 of 12 values are NaN or infinite"),
    (lambda x: x.index_fill(0, __import__("torch").tensor([0]), float("inf")), None, "1 of 12 values are NaN"),
    (lambda x: x * 0, None, "every value of P is zero"),
    (lambda x: -x, None, "negative values"),
    (lambda x: x * 3, None, "marginals are far from the file's own mu and nu"),
    (None, {"shape": "[3, 4"}, "damaged metadata: shape '\\[3, 4' is not"),
    (None, {"shape": None}, "damaged metadata: shape None"),
    (None, {"target_tokenizer_hash": None}, "damaged metadata: target_tokenizer_hash is missing"),
    (None, {"kind": "magic"}, "damaged metadata: kind 'magic'"),
])
def test_p_file_values_and_metadata_are_checked_at_load(tmp_path, values, meta, match):
    from s2t2_dist.translator.pfile import load_p
    from s2t2_dist.errors import PFileError

    f = _p_file(tmp_path / "P.safetensors", values, meta)
    with pytest.raises(PFileError, match=match):
        load_p(f)


def test_a_good_p_file_loads_and_a_signed_unconstrained_one_too(tmp_path):
    from s2t2_dist.translator.pfile import load_p

    assert load_p(_p_file(tmp_path / "a.safetensors")).shape == (3, 4)
    assert load_p(_p_file(tmp_path / "b.safetensors", lambda x: -x, kind="unconstrained")).kind == "unconstrained"


def test_fasta_with_bom_and_cr_only_line_endings_reads_like_lf(tmp_path):
    from s2t2_dist.data.fasta import read_fasta

    lf = tmp_path / "lf.fasta"
    lf.write_bytes(b">a one\nACDE\nFG\n>b\nKLM\n")
    want = [(r.id, r.text, r.pos) for r in read_fasta(lf)]
    for name, data in (("bom", b"\xef\xbb\xbf" + lf.read_bytes()), ("cr", lf.read_bytes().replace(b"\n", b"\r")),
                       ("bom_crlf", b"\xef\xbb\xbf" + lf.read_bytes().replace(b"\n", b"\r\n"))):
        f = tmp_path / f"{name}.fasta"
        f.write_bytes(data)
        assert [(r.id, r.text, r.pos) for r in read_fasta(f)] == want == [("a", "ACDEFG", 1), ("b", "KLM", 4)]


def test_the_same_input_twice_or_through_a_symlink_is_refused(tmp_path):
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.stages.checks import distinct_inputs

    a = tmp_path / "a.fasta"
    a.write_text(">x\nACD\n")
    (tmp_path / "link.fasta").symlink_to(a)
    (tmp_path / "copy.fasta").write_text(">x\nACD\n")
    (tmp_path / "other.fasta").write_text(">y\nKLM\n")
    assert len(distinct_inputs([str(a), str(tmp_path / "other.fasta")])) == 2
    with pytest.raises(ConfigError, match="link.fasta is the same file as .*a.fasta"):
        distinct_inputs([str(a), str(tmp_path / "link.fasta")])
    with pytest.raises(ConfigError, match="a.fasta is the same file as"):
        distinct_inputs([str(a), str(a)])
    with pytest.raises(ConfigError, match="copy.fasta has the same content as"):
        distinct_inputs([str(a), str(tmp_path / "copy.fasta")])


_HOLD = """
import sys, time
from s2t2_dist.utils.rundir import claim
claim(sys.argv[1], "prepare")
print("held", flush=True)
time.sleep(600)
"""


def test_second_run_on_a_locked_directory_is_refused_naming_the_holder_until_it_dies(tmp_path, inputs, capsys):
    """Real processes: one holds the run directory's lock; a real `prepare` into it is refused in one line naming
    the holder's pid; after SIGKILL of the holder (no clean-up at all) the lock is free again."""
    import os
    import signal
    import subprocess
    import sys

    from s2t2_dist.stages import prepare as prepare_stage
    from tests.helpers.stage_fixtures import protein_fasta

    out = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = [f"inputs=[{protein_fasta()}]", "vocab_size=40", f"output_dir={out}", "--no-progress"]
        line = _one_line_error(capsys, prepare_stage.main(argv))
        assert "is in use by another run (s2t2 prepare on host" in line and f"pid {holder.pid}," in line, line
        assert not (out / "splits").exists()  # refused before any work
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    from s2t2_dist.utils.rundir import lock, release

    lock(out, "prepare")  # the OS dropped the dead holder's lock
    release(out)


def test_a_run_directory_of_another_stage_or_linked_out_is_refused(tmp_path):
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.utils.rundir import check_owner, claim, release

    run = tmp_path / "t"
    claim(run, "translate")
    release(run)
    check_owner(run, "translate")  # the same stage resumes
    with pytest.raises(ConfigError, match=r"run_dir: .*/t belongs to a translate run \(run [0-9a-f]{12} of"):
        check_owner(run, "evaluate")
    legacy = tmp_path / "old_translate"  # from before markers: told by its files
    legacy.mkdir()
    (legacy / "P.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="belongs to a translate run \\(files from before run markers\\)"):
        check_owner(legacy, "finetune")
    (tmp_path / "elsewhere").mkdir()
    (run / "result.json").symlink_to(tmp_path / "elsewhere" / "result.json")
    with pytest.raises(ConfigError, match="result.json is a symbolic link to .*out of the run directory"):
        check_owner(run, "translate")


def test_export_dir_of_another_run_is_refused_before_training(tmp_path):
    from s2t2_dist.errors import ConfigError
    from s2t2_dist.stages.checks import export_dir
    from s2t2_dist.utils.rundir import claim, release, run_id

    a, b = tmp_path / "ft_a", tmp_path / "ft_b"
    for d in (a, b):
        claim(d, "finetune")
        release(d)
    exp = tmp_path / "export"
    exp.mkdir()
    (exp / "model.safetensors").write_bytes(b"weights of a")
    (exp / "s2t2_export.json").write_text(json.dumps({"run_id": run_id(a)}))
    export_dir(str(exp), str(a))  # its own export: re-exported
    with pytest.raises(ConfigError, match=f"export.dir: {exp} already holds an export of run {run_id(a)}"):
        export_dir(str(exp), str(b))
    export_dir(str(b / "final"), str(b))  # inside its own run directory
    export_dir(str(tmp_path / "new_export"), str(b))  # new


def test_metrics_logger_writes_no_event_file_until_the_first_value(tmp_path):
    from s2t2_dist.train.metrics import MetricsLogger

    log = MetricsLogger(tmp_path / "tb", rank=0, node_rank=0, local_rank=0)
    assert not (tmp_path / "tb").exists()  # a run refused after setup leaves no empty event files
    log.scalars(1, {"x": 1.0})
    log.close()
    assert list((tmp_path / "tb" / "global").iterdir())


def test_unwritable_output_dirs_are_refused_before_any_work_for_an_unprivileged_user():
    """PermissionError from an unwritable run, export or cache directory was a traceback (for export.dir only after
    every training step). Through the real command, without root's privileges (root may write anywhere: the
    command runs with every capability dropped, `setpriv`, on a directory owned by nobody)."""
    import os
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (to make a directory another user owns) and setpriv")
    base = Path(tempfile.mkdtemp(prefix="s2t2_perm_"))
    try:
        (base / "ro").mkdir(mode=0o755)
        os.chown(base / "ro", 65534, 65534)  # nobody's: without capabilities, root may not write here
        fa = base / "x.fasta"
        fa.write_text(">a\nACDE\n")

        def run(*args):
            cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", sys.executable, "-m", "s2t2_dist.cli",
                   *map(str, args)]
            env = {**os.environ, "PYTHONPATH": str(REPO), "S2T2_DEVICE": "cpu"}
            return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=base, timeout=300)

        common = ["model.path=m", "data.train=t", "data.tokenizer=k"]
        for stage, args, key in (
                ("translate", [f"run_dir={base / 'ro' / 'run'}", *common], "run_dir"),
                ("finetune", [f"run_dir={base / 'ft'}", f"export.dir={base / 'ro' / 'export'}", "init.p_file=p",
                              *common], "export.dir"),
                ("evaluate", [f"run_dir={base / 'ev'}", "model.path=m", "init.kind=as_is", f"data.files=[{fa}]",
                              f"data.cache_dir={base / 'ro' / 'cache'}"], "data.cache_dir"),
                ("prepare", [f"inputs=[{fa}]", f"output_dir={base / 'ro' / 'data'}"], "output_dir")):
            p = run(stage, *args)
            err = [ln for ln in p.stderr.splitlines() if ": error: " in ln]
            assert p.returncode == 2 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
            assert f"{key}: cannot write into {base / 'ro'} (permission denied)" in err[0], err[0]
        assert not any((base / "ro").iterdir())
        assert sorted(p.name for p in base.iterdir()) == ["ro", "x.fasta"]  # nothing written anywhere
    finally:
        shutil.rmtree(base, ignore_errors=True)
