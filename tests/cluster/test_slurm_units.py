"""Fast checks of the SLURM launch layer that need no cluster: TensorBoard logging read back with TensorBoard's
own reader, P sparsity statistics (also column-sharded over 2 gloo ranks), rank discovery, the submit config."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from s2t2_dist.distributed.env import default_backend, detect
from s2t2_dist.cluster.layout import timeout_minutes
from s2t2_dist.cluster.submit import (
    RENDEZVOUS_SETUP, SlurmConfig, StageJob, build_executor, resolve_slurm_config)
from s2t2_dist.train.metrics import MetricsLogger, heatmap_image

REPO = Path(__file__).resolve().parents[2]


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_metrics_global_and_per_node_dirs_read_back(tmp_path):
    # rank 0 (node 0), rank 1 (node 0, not first), rank 2 (first of node 1): what a 2x2 job creates
    loggers = [MetricsLogger(tmp_path, rank=r, node_rank=r // 2, local_rank=r % 2) for r in range(4)]
    for step in (1, 2, 3):
        for lg in loggers:
            lg.scalars(step, {"train/loss": 1.0 / step})  # reduced value: only rank 0 writes it
            lg.scalars(step, {"node/step_time_s": 0.1 * step}, scope="node")
    for lg in loggers:
        lg.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global", "node_000", "node_001"]
    g = _accumulator(tmp_path / "global")
    assert [e.step for e in g.Scalars("train/loss")] == [1, 2, 3]
    assert g.Scalars("train/loss")[-1].value == pytest.approx(1 / 3)
    assert "node/step_time_s" not in g.Tags()["scalars"]
    for node in ("node_000", "node_001"):
        n = _accumulator(tmp_path / node)
        assert n.Tags()["scalars"] == ["node/step_time_s"]
        assert [round(e.value, 4) for e in n.Scalars("node/step_time_s")] == [0.1, 0.2, 0.3]
    with pytest.raises(ValueError):
        loggers[0].scalars(1, {"x": 1.0}, scope="nodes")


def test_metrics_text_heatmap_and_histogram_read_back(tmp_path):
    lg = MetricsLogger(tmp_path, rank=0, node_rank=0, local_rank=0)
    P = torch.zeros(40, 12)
    P[torch.arange(12) * 3, torch.arange(12)] = 1.0  # one source per target
    P[1, 0] = 0.5
    lg.scalars(5, {"P/density": 13 / (40 * 12)})
    lg.text(5, "P/top_translations", "| `ATG` | `the` 0.610 |")
    lg.heatmap(5, "P/heatmap", P)
    lg.histogram(5, "P/support_per_target", (P > 0).sum(0))
    lg.close()
    acc = _accumulator(tmp_path / "global")
    tags = acc.Tags()
    assert acc.Scalars("P/density")[0].value == pytest.approx(13 / (40 * 12))
    text_tag = next(t for t in tags["tensors"] if t.startswith("P/top_translations"))
    text = acc.Tensors(text_tag)[0].tensor_proto.string_val[0].decode()
    assert text == "| `ATG` | `the` 0.610 |"
    assert tags["images"] == ["P/heatmap"]
    img = acc.Images("P/heatmap")[0]
    assert img.step == 5 and img.height > 40 and img.width > 12  # enlarged for viewing
    assert "P/support_per_target" in tags["histograms"]


def test_heatmap_keeps_isolated_entries_and_ignores_nan():
    m = torch.zeros(3000, 50)
    m[1234, 7] = 1e-3
    m[0, 0] = float("nan")
    img = heatmap_image(m, max_pixels=256)
    assert img.dtype.name == "uint8" and img.shape[2] == 3 and max(img.shape[:2]) <= 256
    bright = (img.astype(int).sum(-1) > img[0, 0].astype(int).sum()).nonzero()
    assert len(bright[0]) == 1  # the one entry survived max-pooling (and NaN is drawn as 0)
    with pytest.raises(ValueError):
        heatmap_image(torch.zeros(3))


def test_detect_srun_prefers_exported_master_addr():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1234567",
           "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": "10.0.0.7"}
    d = detect(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank, d.num_nodes) == (3, 4, 1, 2, 1, 2)
    assert (d.master_addr, d.master_port, d.launcher) == ("10.0.0.7", 20000 + 1234567 % 12000, "slurm")
    assert detect({**env, "S2T2_MASTER_ADDR": "10.0.0.9"}).master_addr == "10.0.0.9"
    # what StageJob exports under submitit: the torchrun-style variables win
    d = detect({**env, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "MASTER_PORT": "29555"})
    assert (d.rank, d.node_rank, d.num_nodes, d.master_port) == (2, 1, 2, 29555)


def test_rendezvous_one_computation_for_python_and_the_batch_shell():
    """distributed/rendezvous.py is the one place: what `eval "$(python -m s2t2_dist.distributed.rendezvous)"` exports in the
    batch script is what detect() computes in a rank; S2T2_MASTER_* win, a MASTER_PORT inherited from the
    submitting shell does not."""
    import sys

    from s2t2_dist.distributed.rendezvous import slurm_port

    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "S2T2_MASTER_"))}

    def exported(**env) -> list[str]:
        out = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m s2t2_dist.distributed.rendezvous)"; '
                              'echo "$MASTER_ADDR $MASTER_PORT"'], env={**base, **env}, capture_output=True,
                             text=True, check=True).stdout
        return out.split()

    assert exported(SLURM_JOB_ID="1234567", S2T2_MASTER_ADDR="10.0.0.7", MASTER_PORT="999") == \
        ["10.0.0.7", str(20000 + 1234567 % 12000)]
    assert exported(SLURM_JOB_ID="1234567", S2T2_MASTER_ADDR="10.0.0.7", S2T2_MASTER_PORT="4242")[1] == "4242"
    rank_env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1(x2)", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1234567",
                "SLURM_JOB_NODELIST": "n[1-2]", "S2T2_MASTER_ADDR": "10.0.0.7"}
    d = detect(rank_env)
    assert [d.master_addr, str(d.master_port)] == exported(**rank_env)
    assert slurm_port({"SLURM_JOB_ID": "5", "MASTER_PORT": "29555"}) == 29555  # a launcher's port wins in a rank
    assert slurm_port({"SLURM_JOB_ID": "5", "S2T2_MASTER_PORT": "4242"}) == 4242


def test_detect_deepspeed_launcher_node_layout():
    # what deepspeed.launcher.launch gives rank 2 of 2 nodes x 2 (inside an srun task: SLURM_* of that task too)
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
           "CROSS_SIZE": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29600", "SLURM_PROCID": "1",
           "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    d = detect(env)
    assert (d.rank, d.world_size, d.local_rank, d.local_world_size, d.node_rank, d.num_nodes, d.launcher) == \
        (2, 4, 0, 2, 1, 2, "deepspeed")


def test_cpu_device_forces_gloo(monkeypatch):
    monkeypatch.setenv("S2T2_DEVICE", "cpu")
    assert default_backend() == "gloo"


def test_timeout_minutes():
    assert [timeout_minutes(t) for t in ("90", 45, "1:30", "02:00:00", "1-0", "1-02:30", "0:0:59")] == \
        [90, 45, 2, 120, 1440, 1590, 1]
    with pytest.raises(ValueError):
        timeout_minutes("2h")


def test_slurm_config_precedence(tmp_path):
    stage_cfg = tmp_path / "stage.yaml"
    stage_cfg.write_text("slurm:\n  nodes: 4\n  gpus_per_node: 8\n  time: 8:00:00\n  partition: a100\n"
                         "train:\n  steps: 10\n")
    site = tmp_path / "site.yaml"
    site.write_text("partition: h100\naccount: proj\nenv:\n  NCCL_DEBUG: WARN\n")
    cfg, rest = resolve_slurm_config(
        ["--config", str(stage_cfg), "train.steps=5", "slurm.qos=high", "slurm.additional.exclusive=true"],
        str(site), {"nodes": 2, "time": None})
    assert rest == ["--config", str(stage_cfg), "train.steps=5"]
    assert (cfg.nodes, cfg.gpus_per_node, cfg.ntasks_per_node, cfg.partition, cfg.account, cfg.qos) == \
        (2, 8, 8, "h100", "proj", "high")
    assert cfg.time == "8:00:00" and timeout_minutes(cfg.time) == 480  # not YAML 1.1's 28800
    assert cfg.additional == {"exclusive": True} and cfg.env == {"NCCL_DEBUG": "WARN"}
    with pytest.raises(ValueError, match="nodez"):
        resolve_slurm_config(["slurm.nodez=2"], None, {})
    with pytest.raises(ValueError, match="time"):
        resolve_slurm_config([], None, {"time": "soon"})


def test_submitit_batch_script_has_resources_requeue_and_rendezvous(tmp_path):
    cfg = SlurmConfig(nodes=2, gpus_per_node=4, cpus_per_task=6, time="2:00:00", partition="gpu", account="acc",
                      qos="normal", mem="64G", folder=str(tmp_path / "%j"), setup=["module load cuda"])
    ex = build_executor(cfg, cluster="slurm")
    text = ex._executor._make_submission_file_text("python -m x", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=6", "--time=120",
                 "--partition=gpu", "--account=acc", "--qos=normal", "--mem=64G", "--requeue",
                 "--signal=USR2@120"):
        assert f"#SBATCH {line}\n" in text, line
    assert RENDEZVOUS_SETUP[0] in text and "module load cuda" in text
    cpu = build_executor(SlurmConfig(folder=str(tmp_path / "%j")), cluster="slurm")
    assert "gpus-per-node" not in cpu._executor._make_submission_file_text("x", "u")


def test_stage_job_pickles_and_checkpoints_itself():
    import cloudpickle

    job = StageJob("probe", ["--out", "x"], env={"S2T2_DEVICE": "cpu"})
    again = pickle.loads(cloudpickle.dumps(job))
    assert (again.stage, again.argv, again.env) == ("probe", ["--out", "x"], {"S2T2_DEVICE": "cpu"})
    delayed = job.checkpoint()
    assert delayed.function is job and delayed.args == () and delayed.kwargs == {}
    with pytest.raises(ValueError):
        StageJob("nope", [])


def test_slurm_scripts_parse_and_carry_the_headers():
    for f in sorted((REPO / "slurm").glob("*.sh")):
        subprocess.run(["bash", "-n", str(f)], check=True)
    for name in ("translate_1b.sh", "finetune_7b.sh"):
        text = (REPO / "slurm" / name).read_text()
        for opt in ("--nodes=", "--ntasks-per-node=", "--gpus-per-node=", "--cpus-per-task=", "--time=",
                    "--output=%x-%j.out", "--signal=B:USR1@", "--requeue"):
            assert f"#SBATCH {opt}" in text, (name, opt)
    # outside an allocation the scripts refuse to run, with a hint
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = subprocess.run(["bash", str(REPO / "slurm" / "translate_1b.sh")], env={**env, "S2T2_HOME": str(REPO)},
                         capture_output=True, text=True)
    assert res.returncode == 2 and "sbatch" in res.stderr


def test_submit_flags_are_the_slurm_config_scalars_with_their_comments():
    """`s2t2 submit`'s resource flags are generated from SlurmConfig: every scalar key has one, with its `#:`
    comment as help, and a flag parses into the key (a new key needs no edit of the parser)."""
    import argparse
    from dataclasses import fields

    from s2t2_dist.cluster.submit import SlurmConfig, _add_slurm_flags
    from s2t2_dist.config_docs import field_docs

    p = argparse.ArgumentParser()
    names = _add_slurm_flags(p)
    scalars = {f.name for f in fields(SlurmConfig) if f.type in (int, str, "int", "str")}
    assert names == scalars and {"nodes", "gpus_per_node", "signal_delay_s"} <= names
    docs = field_docs(SlurmConfig)
    helps = {a.dest: a.help for a in p._actions if a.dest in names}
    assert all(helps[n] and helps[n].replace("%%", "%") == docs[n] for n in names)
    args = p.parse_args(["--gpus-per-node", "4", "--job-name", "x"])
    assert (args.gpus_per_node, args.job_name, args.nodes) == (4, "x", None)
