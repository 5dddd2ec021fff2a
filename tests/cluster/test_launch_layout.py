"""The shipped launch files without a cluster: every shipped training config's batch layout at 1 to 32
ranks, the layouts the scripts and docs show, the refusal of an impossible layout before queueing (`s2t2 submit`)
and before any rank starts (the scripts' pre-flight), the time-limit signal's lead from the checkpoint size, and
every `configs/...` path that the scripts, docs and README name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from s2t2_dist.cluster import layout
from s2t2_dist.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TRAINING = {"translate_olmo1b.yaml": "translate", "translate_paper.yaml": "translate",
            "finetune_olmo1b.yaml": "finetune", "finetune_olmo7b.yaml": "finetune"}
STAGE_OF = {**TRAINING, "evaluate_olmo1b.yaml": "evaluate", "evaluate_transfer_7b.yaml": "evaluate",
            "prepare_demo.yaml": "prepare", "prepare_text.yaml": "prepare", "prepare_uniref50.yaml": "prepare"}


def _cfg(name: str, *overrides: str):
    if STAGE_OF[name] == "prepare":  # prepare checks that its inputs exist: the shipped sample stands in
        overrides = (f"inputs=[{REPO}/s2t2_dist/assets/protein/esm_some_proteins_uniref50.fasta]", *overrides)
    return layout.parse_stage_config(STAGE_OF[name], ["--config", str(REPO / "configs" / name), *overrides])


def test_every_shipped_config_is_known_here_and_parses():
    shipped = {p.name for p in (REPO / "configs").glob("*.yaml")}
    assert shipped == set(STAGE_OF), "a new config in configs/: add it to STAGE_OF (and to the cluster test)"
    for name in shipped:
        _cfg(name)


@pytest.mark.parametrize("name", sorted(TRAINING))
def test_shipped_training_configs_fit_1_to_16_ranks_and_refuse_32_in_one_line(name):
    cfg = _cfg(name)
    assert cfg.train.micro_batch_size == "auto"
    got = {w: (layout.check_layout(cfg, w, f"{w} ranks"), cfg.train.grad_accum(w)) for w in (1, 2, 8, 16)}
    # batch 16 of 512 tokens, at most 4096 tokens per forward pass
    assert got == {1: (8, 2), 2: (8, 1), 8: (2, 1), 16: (1, 1)}
    with pytest.raises(ConfigError) as e:
        layout.check_layout(cfg, 32, "slurm.nodes=4 x slurm.tasks_per_node=8 = 32 ranks")
    msg = str(e.value)
    assert "\n" not in msg and "train.batch_size=16" in msg and "slurm.nodes=4" in msg
    assert "slurm.tasks_per_node=8" in msg and "train.micro_batch_size" in msg and "impossible layout" in msg


def test_micro_batch_auto_rule_and_fixed_micro_batch_refusal():
    from s2t2_dist.train.config import TrainConfig

    t = TrainConfig(batch_size=24, micro_batch_size="auto", context_len=1024, max_micro_tokens=5000)
    # per rank 24 / W; the largest divisor with <= 5000 // 1024 = 4 sequences
    assert [t.micro_for(w) for w in (1, 2, 3, 4, 8, 24)] == [4, 4, 4, 3, 3, 1]
    t.resolve_layout(4)
    assert (t.micro_batch_size, t.grad_accum(4)) == (3, 2)
    fixed = TrainConfig(batch_size=16, micro_batch_size=2)  # what the configs said before: fails on 16 ranks
    assert fixed.grad_accum(8) == 1
    with pytest.raises(ConfigError, match=r"micro_batch_size x ranks = 2 x 16: .*train.micro_batch_size=auto"):
        fixed.grad_accum(16)


def _script_layouts() -> list[tuple[str, int, int, str]]:
    """(script, nodes, tasks per node, config) for each script's header default, and for every `sbatch` line of
    the scripts' headers, docs/slurm.md and README.md that changes --nodes or --ntasks-per-node."""
    out = []
    lines = []
    for f in [*(REPO / "slurm").glob("*.sh"), REPO / "docs" / "slurm.md", REPO / "README.md"]:
        lines += [ln for ln in f.read_text().splitlines() if "sbatch " in ln and "slurm/" in ln]
    for script in sorted((REPO / "slurm").glob("*.sh")):
        text = script.read_text()
        if "#SBATCH" not in text:
            continue
        nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
        tpn = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
        cfg = re.search(r'S2T2_CONFIG:=([^}]+)\}', text).group(1)
        out.append((script.name, nodes, tpn, cfg))
        for ln in lines:
            if f"slurm/{script.name}" not in ln:
                continue
            n = re.search(r"--nodes[= ](\d+)", ln)
            t = re.search(r"--ntasks-per-node[= ](\d+)", ln)
            c = re.search(r"--config (configs/[\w./-]+)", ln)
            out.append((script.name, int(n.group(1)) if n else nodes, int(t.group(1)) if t else tpn,
                        c.group(1) if c else cfg))
    return out


def test_every_layout_the_scripts_and_docs_show_is_possible():
    layouts = _script_layouts()
    assert ("translate_1b.sh", 2, 8, "configs/translate_olmo1b.yaml") in layouts  # `sbatch --nodes=2 ...` (issue)
    assert ("finetune_7b.sh", 2, 8, "configs/finetune_olmo7b.yaml") in layouts
    for script, nodes, tpn, cfg_path in layouts:
        cfg = _cfg(Path(cfg_path).name)
        layout.check_layout(cfg, nodes * tpn, f"{script}: {nodes} x {tpn}")
    # the `s2t2 submit` lines of the docs: --nodes N --gpus-per-node G
    for ln in (REPO / "docs" / "slurm.md").read_text().splitlines():
        m = re.search(r"submit \w+ --config (configs/\S+) --nodes (\d+) --gpus-per-node (\d+)", ln)
        if m:
            layout.check_layout(_cfg(Path(m.group(1)).name), int(m.group(2)) * int(m.group(3)), ln)


def test_signal_lead_from_checkpoint_size_for_the_shipped_1b_and_7b_configs():
    b7 = layout.checkpoint_bytes("finetune", _cfg("finetune_olmo7b.yaml"))
    b1 = layout.checkpoint_bytes("finetune", _cfg("finetune_olmo1b.yaml"))
    t1 = layout.checkpoint_bytes("translate", _cfg("translate_olmo1b.yaml"))
    assert 105e9 < b7 < 115e9 and 18e9 < b1 < 20e9 and t1 < 10e9  # 6.89 B and 1.18 B parameters x 16 bytes
    assert [layout.signal_lead_s(b7, n) for n in (1, 2)] == [480, 300]  # 120 + 1.5 x 110 GB / (0.5 GB/s x nodes)
    assert layout.signal_lead_s(b1, 1) == layout.signal_lead_s(t1, 1) == 180
    assert layout.signal_lead_s(0, 1) == 120  # evaluate, prepare: no checkpoint
    assert layout.checkpoint_bytes("evaluate", _cfg("evaluate_olmo1b.yaml")) == 0
    # the scripts' headers give at least the lead their default config needs on one node
    for script, cfg_name, stage in (("translate_1b.sh", "translate_olmo1b.yaml", "translate"),
                                    ("finetune_7b.sh", "finetune_olmo7b.yaml", "finetune")):
        header = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", (REPO / "slurm" / script).read_text()).group(1))
        assert header >= layout.signal_lead_s(layout.checkpoint_bytes(stage, _cfg(cfg_name)), 1), script


def test_submit_refuses_an_impossible_layout_before_queueing(tmp_path, capsys, monkeypatch):
    from s2t2_dist.cluster import submit

    queued = []
    monkeypatch.setattr(submit, "submit_stage", lambda *a, **k: queued.append(a))
    rc = submit.main(["finetune", "--config", str(REPO / "configs" / "finetune_olmo7b.yaml"), "--nodes", "4",
                      "--gpus-per-node", "8", "--folder", str(tmp_path / "sub"), "--cluster", "debug"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not queued and not (tmp_path / "sub").exists()
    assert len(err.splitlines()) == 1, err
    assert "train.batch_size=16" in err and "slurm.nodes=4 x slurm.tasks_per_node=8 = 32 ranks" in err
    # a fixed micro-batch that does not fit: names it too
    rc = submit.main(["translate", "--config", str(REPO / "configs" / "translate_olmo1b.yaml"),
                      "train.micro_batch_size=2", "--nodes", "2", "--gpus-per-node", "8", "--cluster", "debug"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not queued and "micro_batch_size x ranks = 2 x 16" in err


def test_submit_derives_the_signal_delay_from_the_config():
    from s2t2_dist.cluster.submit import SlurmConfig, check_stage_config

    argv = ["--config", str(REPO / "configs" / "finetune_olmo7b.yaml")]
    auto = SlurmConfig(nodes=2, gpus_per_node=8)
    check_stage_config("finetune", argv, auto)
    assert auto.signal_delay_s == 300
    given = SlurmConfig(nodes=2, gpus_per_node=8, signal_delay_s=900)
    check_stage_config("finetune", argv, given)
    assert given.signal_delay_s == 900


def _preflight(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, "-m", "s2t2_dist.cluster.layout", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_script_preflight_refuses_in_one_line_and_logs_the_lead():
    cfg = ["--config", "configs/finetune_olmo7b.yaml"]
    bad = _preflight({"SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS": "32", "SLURM_NTASKS_PER_NODE": "8(x4)"},
                     "finetune", *cfg)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--nodes=4 x --ntasks-per-node=8 = 32 ranks" in bad.stderr and "train.batch_size=16" in bad.stderr
    ok = _preflight({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8(x2)"},
                    "finetune", *cfg)
    assert ok.returncode == 0, ok.stderr
    assert "micro-batch 1 x 1 accumulation step(s) x 16 ranks" in ok.stdout and "300 s ahead" in ok.stdout


def test_a_time_limit_shorter_than_the_signal_lead_is_refused(tmp_path, capsys, monkeypatch):
    """A job whose time limit is not longer than the final checkpoint's signal lead would get the signal at once
    and requeue without training, forever: `s2t2 submit` refuses before queueing, the batch shell's pre-flight
    (the job's limit from squeue) before any rank starts."""
    from s2t2_dist.cluster import submit

    queued = []
    monkeypatch.setattr(submit, "submit_stage", lambda *a, **k: queued.append(a))
    base = ["translate", "--config", str(REPO / "configs" / "translate_olmo1b.yaml"), "--nodes", "1",
            "--gpus-per-node", "2", "--folder", str(tmp_path / "sub"), "--cluster", "debug"]
    rc = submit.main([*base, "--time", "3"])  # 180 s: the lead OLMo-1B stage 1 needs
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not queued and len(err.splitlines()) == 1, err
    assert "slurm.time=3" in err and "180 s" in err
    submit.check_stage_config("translate", base[1:3], submit.SlurmConfig(nodes=1, gpus_per_node=2, time="4"))
    # the batch shell: a fake squeue reports the running job's limit
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text("#!/bin/sh\necho \"$LIMIT\"\n")
    squeue.chmod(0o755)
    env = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "77",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cfg = ["translate", "--config", "configs/translate_olmo1b.yaml"]
    short = _preflight({**env, "LIMIT": "2:00"}, *cfg)
    assert short.returncode == 2 and len(short.stderr.strip().splitlines()) == 1, short.stderr
    assert "time limit of job 77 = 120 s" in short.stderr and "180 s" in short.stderr
    for limit in ("8:00:00", "UNLIMITED"):
        ok = _preflight({**env, "LIMIT": limit}, *cfg)
        assert ok.returncode == 0 and "180 s ahead" in ok.stdout, ok.stderr


def test_every_configs_path_named_in_scripts_docs_and_readme_exists():
    roots = [REPO / "README.md", REPO / "slurm", REPO / "docs", REPO / "configs", REPO / "launch",
             REPO / "s2t2_dist" / "cluster", REPO / "s2t2_dist" / "stages", REPO / "s2t2_dist" / "recipes"]
    files = [f for r in roots for f in ([r] if r.is_file() else r.rglob("*")) if f.is_file()
             and f.suffix in (".md", ".sh", ".yaml", ".py", ".json")]
    named = {}
    for f in files:
        for m in re.finditer(r"(?<![\w/.])configs/[\w./-]+\.(?:yaml|json)", f.read_text(errors="replace")):
            named.setdefault(m.group(0), f.relative_to(REPO))
    assert len(named) >= 8
    missing = {p: str(f) for p, f in named.items() if not (REPO / p).is_file()}
    assert not missing
