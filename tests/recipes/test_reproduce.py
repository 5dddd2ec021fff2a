"""`s2t2 reproduce`: the tiny scale end to end (every Table 1 column, the transfer experiment, table, plots, report)
and the paper-scale plan (printed SLURM submissions) checked against the real configs, scripts and stage CLIs."""

import json
import math
import subprocess
import sys

import pytest

from s2t2_dist.errors import ConfigError
from s2t2_dist.recipes.reproduce import (
    KINDS,
    TABLE1,
    Setting,
    build_plan,
    paper_script,
    paper_setting,
    preset,
    translate_job,
    validate_plan,
    with_overrides,
)
from tests.helpers.stage_fixtures import REPO, run_cmd


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------------------------
# tiny scale, end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce") / "tiny"
    proc = run_cmd([sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "tiny", "--out", str(out)],
                   timeout=900)
    return out, proc.stdout


@pytest.mark.slow
def test_tiny_table1_every_column(tiny):
    out, stdout = tiny
    r = json.loads((out / "results.json").read_text())
    assert r["missing_runs"] == []
    for key in (*TABLE1, "s2t2_default", "fvt"):  # + S2T2 with the shipped defaults and the training-free FVT start
        col = r["table1"][key]
        assert col["bpb"]["n"] == 1 and math.isfinite(col["bpb"]["mean"]) and col["bpb"]["mean"] > 0, key
        assert math.isfinite(col["perplexity"]["mean"]), key
    # u = 256 target tokens; the random-guess line is ln u nats per token
    assert r["random_guess"]["new_tok_table1"]["nll_per_token"] == pytest.approx(math.log(256))
    # same budget: every finetune ran ft_steps, every P ran p_steps
    cfg = r["config"]
    for name, run in r["runs"].items():
        if run["stage"] in ("translate", "finetune"):
            res = json.loads((out / "runs" / name / "result.json").read_text())
            want = 0 if name.endswith("translate_fvt") else cfg["p_steps"] if run["stage"] == "translate" \
                else cfg["ft_steps"]  # the FVT start is not trained (train.steps=0 scores the start)
            assert res["step"] == want, name
    # each translator's P lr was chosen among the sweep by training loss, and its Table 1 runs used it
    sel = r["lr_selection"]
    assert set(sel["chosen"]) == set(KINDS.values()) and set(sel["chosen"].values()) <= set(cfg["p_lr_sweep"])
    for method, kind in KINDS.items():
        lr = sel["chosen"][kind]
        assert sel["final_train_loss"][kind][f"{lr:g}"] == min(sel["final_train_loss"][kind].values())
        plan = {j["name"]: j for j in json.loads((out / "plan.json").read_text())}
        assert f"optim.lr={lr}" in plan[f"seed0/translate_{kind}"]["overrides"]
    # the orig-tok baseline really read byte-level shards with the source model's own tokenizer
    orig = r["runs"]["seed0/ft_orig_tok"]["metrics"]
    assert orig["bytes_per_token"] == pytest.approx(1.0)
    assert r["runs"]["seed0/ft_s2t2_cft"]["metrics"]["bytes_per_token"] > 1.3
    table = (out / "table1.md").read_text()
    assert table.count("|") > 40 and "**Perp.**" in table and "**BpB**" in table and "S2T2 + CFT" in table
    assert "FVT start (untrained)" in table and "S2T2 (shipped defaults)" in table
    assert "log2(151.05) = 7.239" in table and "per token" in table  # the paper's FT orig. tok. BpB explained
    # the FVT row really is the surface-string start: init fvt with weight 1, the paper-faithful S2T2 column is
    # still the literal recipe, and the defaults row is not
    plan = {j["name"]: j for j in json.loads((out / "plan.json").read_text())}
    fvt = plan["seed0/translate_fvt"]["overrides"]
    assert "translator.init=fvt" in fvt and "translator.init_weight=1" in fvt
    paper = plan["seed0/translate_sparse"]["overrides"]
    assert "translator.init=uniform" in paper and "translator.floor=0" in paper
    default = plan["seed0/translate_s2t2_default"]["overrides"]
    assert "optim.lr=null" in default and not any(o.startswith("translator.init") for o in default)
    # the untrained FVT start (each target token's residue bytes, projected onto S2T2's marginals) is far from the
    # uniform start (largest weight 1/v, column entropy log v) that the paper-recipe S2T2 column starts from
    P = r["runs"]["seed0/translate_fvt"]["P"]
    assert P["max_weight_mean"] > 10 / P["v"] and P["col_entropy_mean"] < math.log(P["v"]) - 0.1
    assert "table1" in stdout or "report" in stdout


@pytest.mark.slow
def test_tiny_transfer_sparsity_and_checks(tiny):
    out, _ = tiny
    r = json.loads((out / "results.json").read_text())
    for bar in ("s2t2_a0", "s2t2_a0.1", "new_tok", "orig_tok"):
        assert math.isfinite(r["transfer"][bar]["nll_per_token"]["mean"]), bar
    # the transfer applied the SMALL model's P to the LARGE model (same byte vocabulary, more parameters)
    src = r["sources"]
    assert src["large"]["params"] > src["small"]["params"]
    t0 = r["runs"]["seed0/transfer_s2t2_a0"]
    assert "transfer" in t0["run_dir"]
    plan = json.loads((out / "plan.json").read_text())
    job = next(j for j in plan if j["name"] == "seed0/transfer_s2t2_a0")
    assert f"model.path={src['large']['path']}" in job["overrides"]
    assert any(o.startswith("init.p_file=") and o.endswith("translate_sparse/P.safetensors") for o in job["overrides"])
    # P's sparsity per translator / alpha, from the P files
    sp = r["sparsity"]
    kinds = {v["kind"] for v in sp.values()}
    assert kinds == {"sparse", "softmax", "unconstrained"}
    dens = {v["alpha"]: v["density"]["mean"] for v in sp.values()
            if v["kind"] == "sparse" and not v["fvt"] and not v["default"]}
    assert set(dens) == {0.0, 0.1} and all(0 < d <= 1 for d in dens.values())
    # loss curves were read back from the TensorBoard event files of every P run and every finetuning run
    # mass-based sparsity of W = P / nu for every P (1: one source token per target token; 0 nats: one-hot)
    for v in sp.values():
        assert 0 < v["max_weight_mean"]["mean"] <= 1 + 1e-9 and 0 <= v["col_entropy_mean"]["mean"] <= math.log(v["v"]) + 1e-6
    assert sum(v["fvt"] for v in sp.values()) == 1 and sum(v["default"] for v in sp.values()) == 1
    assert set(r["curves"]["translate"]) == set(KINDS) | {"s2t2_default"}
    assert set(r["curves"]["finetune"]) == {k for k in TABLE1 if k not in KINDS}
    assert all(len(c[0]) >= 3 for c in r["curves"]["finetune"].values())
    claims = [c["claim"] for c in r["checks"]]
    assert any("S2T2 + CFT has the best bpb" in c for c in claims) and any("transfer" in c for c in claims)
    assert all(isinstance(c["held"], bool) for c in r["checks"])


@pytest.mark.slow
def test_tiny_plots_and_report(tiny):
    out, _ = tiny
    import matplotlib.image as mpimg

    for name in ("loss_curves", "transfer", "sparsity_vs_alpha", "table1"):
        p = out / "plots" / f"{name}.png"
        assert p.read_bytes()[:8] == PNG_MAGIC, name
        img = mpimg.imread(str(p))
        assert img.shape[0] > 300 and img.shape[1] > 800, (name, img.shape)
        assert img[..., :3].std() > 0.05, name  # not a blank canvas
    report = (out / "report.md").read_text()
    for name in ("loss_curves", "transfer", "sparsity_vs_alpha", "table1"):
        assert f"](plots/{name}.png)" in report
    assert "## Does the paper's ordering hold?" in report and ("**held**" in report or "**NOT held**" in report)
    assert "mean largest weight of W = P/nu" in report and "FVT start (no training)" in report


@pytest.mark.slow
def test_tiny_rerun_reuses_every_run(tiny):
    out, _ = tiny
    proc = run_cmd([sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "tiny", "--out", str(out)],
                   timeout=300)
    cfg = json.loads((out / "results.json").read_text())["config"]
    n_runs = len(json.loads((out / "plan.json").read_text())) + len(KINDS) * len(cfg["p_lr_sweep"])
    assert proc.stdout.count("(reused)") == n_runs
    # a copy of the output directory is the same reproduction: every run reused there too (runs are identified
    # relative to --out)
    import shutil

    copy = out.parent / "tiny_copy"
    shutil.copytree(out, copy)
    proc = run_cmd([sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "tiny", "--out", str(copy)],
                   timeout=300)
    assert proc.stdout.count("(reused)") == n_runs
    assert json.loads((copy / "results.json").read_text())["table1"] == json.loads(
        (out / "results.json").read_text())["table1"]


# ----------------------------------------------------------------------------------------------------------------
# paper scale: the plan


def test_paper_plan_is_valid_and_complete():
    cfg = with_overrides(preset("paper"), [])
    jobs = build_plan(cfg, paper_setting())
    assert validate_plan(jobs) == []
    roles = {j.role[:2] for j in jobs if j.role}
    assert {("table1", k) for k in TABLE1} <= roles
    assert {("transfer", b) for b in ("s2t2_a0", "s2t2_a0.01", "s2t2_a0.1", "s2t2_a1", "new_tok", "orig_tok")} <= roles
    by = {j.name: j for j in jobs}
    # the paper's settings: OLMo-1B for Table 1 and for learning P, OLMo-7B for the transfer; 2000 steps; P lr 1e-3
    # (2e-5 for the transfer runs), finetuning lr 2e-5; UniRef50 with a 512-token BPE
    t = by["seed0/translate_sparse"].overrides
    assert "model.path=allenai/OLMo-1B-hf" in t and "optim.lr=0.001" in t and "train.steps=2000" in t
    assert "optim.lr=2e-05" in by["seed0/translate_sparse_transfer_a0.1"].overrides
    assert "translator.alpha=0.1" in by["seed0/translate_sparse_transfer_a0.1"].overrides
    f = by["seed0/ft_s2t2_cft"].overrides
    assert "optim.lr=2e-05" in f and "init.p_file=runs/paper/seed0/translate_sparse/P.safetensors" in f
    assert "model.path=allenai/OLMo-7B-hf" in by["seed0/transfer_s2t2_a0.1"].overrides
    assert "vocab_size=512" in by["prepare"].overrides
    orig = by["seed0/ft_orig_tok"].overrides
    assert "data.train=data/uniref50/shards/source/train" in orig and "init.kind=orig_tok" in orig


def test_paper_script_lines_are_real_submissions():
    cfg = with_overrides(preset("paper"), [])
    jobs = build_plan(cfg, paper_setting())
    script = paper_script(cfg, jobs)
    lines = [ln for ln in script.splitlines() if "sbatch" in ln]
    assert len(lines) == len(jobs)
    import shlex

    defined = set()
    for ln, j in zip(lines, jobs):
        var, cmd = ln.split("=$(", 1)
        words = shlex.split(cmd.rstrip(")").replace("$", "DOLLAR"))
        env, sbatch = words[0], words[1]
        assert env == f"S2T2_CONFIG={j.config}" and (REPO / j.config).is_file()
        assert sbatch == "sbatch" and "--parsable" in words
        script_path = next(w for w in words if w.startswith("slurm/"))
        assert (REPO / script_path).is_file()
        for w in words:
            if w.startswith("--dependency=afterok:"):
                deps = [d.replace("DOLLAR", "") for d in w.split(":", 1)[1].split(":")]
                assert deps and set(deps) <= defined, (j.name, deps)  # depends only on jobs submitted before
        defined.add(var)
        # the words after the batch script are exactly the job's overrides, which the stage's config loads
        assert words[words.index(script_path) + 1:] == j.overrides
    proc = run_cmd([sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "paper"], timeout=300)
    assert proc.stdout == script and "validated" in proc.stderr


def test_plan_validation_catches_mistakes():
    pytest.importorskip("s2t2_dist.stages.finetune", reason="needs the finetune stage")
    cfg = with_overrides(preset("paper"), [])
    jobs = build_plan(cfg, paper_setting())
    by = {j.name: j for j in jobs}
    by["seed0/translate_sparse"].overrides.append("translator.kindd=sparse")  # misspelt key
    by["seed0/ft_new_tok"].config = "configs/finetune_olmo3b.yaml"  # no such config
    # a consumer submitted before its producer (right after prepare)
    jobs.insert(1, jobs.pop(jobs.index(by["seed0/ft_sinkhorn_p_cft"])))
    problems = "\n".join(validate_plan(jobs))
    assert "translator.kindd" in problems and "did you mean 'kind'" in problems
    assert "finetune_olmo3b.yaml does not exist" in problems
    assert ("seed0/ft_sinkhorn_p_cft (finetune): reads runs/paper/seed0/translate_softmax/P.safetensors, which no "
            "earlier job writes") in problems


def test_paper_collect_without_runs_reports_what_is_missing(tmp_path):
    pytest.importorskip("s2t2_dist.stages.finetune", reason="needs the finetune stage")
    runs = tmp_path / "paper_runs"
    runs.mkdir()
    out = tmp_path / "report"
    res = run_cmd([sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "paper", "--collect", str(runs),
                   "--out", str(out)], timeout=300)
    r = json.loads((out / "results.json").read_text())
    assert f"{len(r['missing_runs'])} of {len(r['missing_runs'])} runs have no result" in res.stderr
    assert len(r["missing_runs"]) == len(build_plan(preset("paper"), paper_setting(str(runs))))
    assert r["checks"][0]["held"] is False and "missing" in r["checks"][0]["detail"]
    assert "Missing runs" in (out / "report.md").read_text()


def test_paper_collect_of_a_missing_directory_is_one_line(tmp_path):
    """A mistyped --collect is a user error naming the option, before anything is written (its default output
    would otherwise land beside a directory that does not exist)."""
    res = subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "paper", "--collect",
                          str(tmp_path / "no_such_runs")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--collect:" in res.stderr and "is not a directory" in res.stderr
    assert not (tmp_path / "reproduce_paper").exists()


def test_overrides_go_through_the_config_system():
    cfg = with_overrides(preset("small"), ["p_steps=7", "seeds=[3,4]", "alphas=[0,0.5]", "large.d_model=96"])
    assert (cfg.p_steps, cfg.seeds, cfg.alphas, cfg.large.d_model) == (7, [3, 4], [0.0, 0.5], 96)
    assert cfg.ft_steps == preset("small").ft_steps  # the rest of the preset is kept
    with pytest.raises(ConfigError, match="p_step"):
        with_overrides(preset("tiny"), ["p_step=3"])
    with pytest.raises(ConfigError, match="alphas"):
        with_overrides(preset("tiny"), ["alphas=[-1]"])


def test_paper_translate_runs_use_the_papers_byte_source_tokens():
    """The paper's source tokens are bytes: the paper-scale stage-1 runs resolve to source_vocab single_byte, the
    paper's C = 1/v start and 3 Dykstra iterations (the local byte LMs keep `all`: bytes plus their BOS/EOS)."""
    from s2t2_dist.config import load_config
    from s2t2_dist.stages.translate import TranslateConfig

    jobs = {j.name: j for j in build_plan(with_overrides(preset("paper"), []), paper_setting())}
    t = jobs["seed0/translate_sparse"]
    tc = load_config(TranslateConfig, REPO / t.config, t.overrides)
    assert (tc.model.source_vocab, tc.translator.init, tc.translator.n_iter) == ("single_byte", "uniform", 3)
    local = translate_job(preset("tiny"), Setting("o", "d", "m1", "m2", "m1"), "x", "sparse", 0.0, 1e-3, 0)
    assert "model.source_vocab=all" in local.overrides
