"""The launch layer against a REAL SLURM cluster started for this module: munged, MariaDB + slurmdbd (accounting),
slurmctld and two slurmd nodes n1, n2 on this host (s2t2_dist.testing.slurm_cluster).

Jobs run the stand-in entry point `python -m s2t2_dist.launch.probe` (rendezvous, all-reduce, the shared training
loop with checkpoints, TensorBoard) on CPU with gloo, through the real slurm/translate_1b.sh and through submitit.
Without the Debian packages the module is skipped, or fails when $CI is set (CI must install them:
.ci/install_slurm.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from s2t2_dist.testing.slurm_cluster import LocalSlurmCluster, missing_packages

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    missing = missing_packages(accounting=True)
    if missing:
        msg = f"SLURM is not installed (missing Debian packages: {' '.join(missing)}); run .ci/install_slurm.sh"
        if os.environ.get("CI"):
            pytest.fail(msg + " -- CI must provide a real SLURM", pytrace=False)
        pytest.skip(msg)
    # its own folder under /tmp (pytest's tmp folders are private to root: munged and MariaDB refuse them);
    # removed at the end unless S2T2_KEEP_SLURM=1 (to read the daemons' logs)
    c = LocalSlurmCluster(nodes=2, cpus_per_node=2, gpus_per_node=2, keep_root=bool(os.environ.get("S2T2_KEEP_SLURM")))
    try:
        c.start()
        yield c
    finally:
        c.stop()
        leftover = c.running()
        assert not leftover, f"daemons still running after stop: {leftover}"


@pytest.fixture
def slurm_env(cluster, monkeypatch):
    """os.environ pointing at the test cluster (submitit calls sbatch/sacct with it)."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return cluster


def _script_env(**extra) -> dict:
    return {"S2T2_HOME": str(REPO), "S2T2_PYTHON": sys.executable, "S2T2_ENTRY": "-m s2t2_dist.launch.probe",
            "S2T2_DEVICE": "cpu", "PYTHONPATH": str(REPO), **extra}


def _ranks(run: Path, attempt: int) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((run / "ranks").glob(f"{attempt}_rank*.json"))]


def _scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}, acc.Tags()


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


def test_cluster_has_two_nodes_and_accounting(cluster):
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t %c %G"], env=cluster.env(), capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert sorted(line.split()[0] for line in out if line) == ["n1", "n2"]
    assert all(" idle 2 gpu:2" in line for line in out if line), out
    assert cluster.node_addr("n2") == "127.0.0.1"
    assert set(cluster.running()) == {"munged", "mariadb", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2"}
    res = subprocess.run(["sacct", "-n", "-X"], env=cluster.env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_sbatch_translate_script_spreads_ranks_and_logs_every_node(cluster, tmp_path):
    run = tmp_path / "run"
    job = cluster.sbatch(REPO / "slurm" / "translate_1b.sh", "--out", str(run), "--steps", "4",
                         sbatch_args=["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                                      "--time=5"],
                         env=_script_env(), cwd=tmp_path)
    state = cluster.wait(job, timeout_s=120)
    log = (tmp_path / f"s2t2-translate-1b-{job}.out").read_text()
    assert state == "COMPLETED", log
    ranks = _ranks(run, 0)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    port = 20000 + int(job) % 20000
    for r in ranks:
        assert (r["world_size"], r["launcher"], r["master_addr"], r["master_port"]) == (4, "slurm", "127.0.0.1", port)
        assert r["allreduce_sum"] == r["expected_sum"] == 10.0
        assert r["nodes_of_ranks"] == ["n1", "n1", "n2", "n2"]
        assert r["finished"] and r["step"] == 4
    assert f"master=127.0.0.1:{port}" in log
    # accounting saw the job on both nodes
    rows = cluster.wait_sacct(job, "COMPLETED")
    assert {"JobID": job, "State": "COMPLETED", "NodeList": "n[1-2]", "ExitCode": "0:0"} in rows
    # TensorBoard: one run directory, global series from rank 0, per-node series from both nodes
    tb = run / "tb"
    assert sorted(p.name for p in tb.iterdir()) == ["global", "node_000", "node_001"]
    g, tags = _scalars(tb / "global")
    assert [s for s, _ in g["train/loss"]] == [1, 2, 3, 4]
    assert g["probe/allreduce_sum"] == [(0, 10.0)]
    assert "probe/weights/text_summary" in tags["tensors"] and tags["images"] == ["probe/weight_outer"]
    for node in ("node_000", "node_001"):
        n, _ = _scalars(tb / node)
        assert [s for s, _ in n["node/tokens_per_s"]] == [1, 2, 3, 4]
        assert n["node/local_world_size"] == [(0, 2.0)]
    assert _scalars(tb / "node_001")[0]["node/node_rank"] == [(0, 1.0)]


def test_sbatch_time_limit_warning_checkpoints_requeues_and_resumes(cluster, tmp_path):
    run = tmp_path / "run"
    job = cluster.sbatch(REPO / "slurm" / "translate_1b.sh", "--out", str(run), "--steps", "12",
                         "--step-time", "0.25", "--ckpt-every", "2",
                         sbatch_args=["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1",
                                      "--time=5"],
                         env=_script_env(), cwd=tmp_path)
    _wait_for(lambda: (run / "checkpoints" / "step_00000002").is_dir(), 90, "no checkpoint")
    # what SLURM does 120 s before the time limit (--signal=B:USR1@120): signal the batch shell only
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env(), check=True)
    cluster.wait(job, states={"PENDING", "REQUEUED", "RUNNING"}, timeout_s=30)
    state = cluster.wait(job, timeout_s=120)
    log = (tmp_path / f"s2t2-translate-1b-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert cluster.job(job)["Restarts"] == "1"
    assert "requeueing (restart 1)" in log and "restart=1" in log
    first, second = _ranks(run, 0), _ranks(run, 1)
    assert [r["preempted"] for r in first] == [True, True] and not any(r["finished"] for r in first)
    stopped_at = first[0]["step"]
    assert 2 <= stopped_at < 12
    assert [(r["resumed_from_step"], r["step"], r["finished"]) for r in second] == [(stopped_at, 12, True)] * 2
    states = [r["State"] for r in cluster.wait_sacct(job, "COMPLETED") if r["JobID"] == job]
    assert states == ["REQUEUED", "COMPLETED"]
    # TensorBoard keeps one value per step across the two attempts
    g, _ = _scalars(run / "tb" / "global")
    assert [s for s, _ in g["train/loss"]] == list(range(1, 13))


@pytest.mark.slow
def test_sbatch_finetune_script_with_deepspeed_launchers(cluster, tmp_path):
    """S2T2_LAUNCHER=deepspeed: one `deepspeed` launcher per node, each starting that node's 2 ranks."""
    run = tmp_path / "run"
    job = cluster.sbatch(REPO / "slurm" / "finetune_7b.sh", "--out", str(run), "--steps", "2",
                         sbatch_args=["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                                      "--time=5"],
                         env=_script_env(S2T2_LAUNCHER="deepspeed", DS_ACCELERATOR="cpu",
                                         PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]),
                         cwd=tmp_path)
    state = cluster.wait(job, timeout_s=150)
    log = (tmp_path / f"s2t2-finetune-7b-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "deepspeed --no_ssh --num_nodes 2 --num_gpus 2 --module s2t2_dist.launch.probe" in log
    ranks = _ranks(run, 0)
    assert [(r["rank"], r["node"], r["node_rank"], r["local_rank"], r["local_world_size"]) for r in ranks] == \
        [(0, "n1", 0, 0, 2), (1, "n1", 0, 1, 2), (2, "n2", 1, 0, 2), (3, "n2", 1, 1, 2)]
    assert all(r["launcher"] == "deepspeed" and r["allreduce_sum"] == 10.0 and r["finished"] for r in ranks)
    assert sorted(p.name for p in (run / "tb").iterdir()) == ["global", "node_000", "node_001"]


def _probe_stage(tmp_path: Path, steps: int, step_time: float, nodes: int = 2):
    from s2t2_dist.launch.submit import SlurmConfig, submit_stage

    cfg = SlurmConfig(nodes=nodes, tasks_per_node=1, cpus_per_task=1, time="5", folder=str(tmp_path / "submitit/%j"),
                      env={"S2T2_DEVICE": "cpu"}, signal_delay_s=30)
    argv = ["--out", str(tmp_path / "run"), "--steps", str(steps), "--step-time", str(step_time)]
    return submit_stage("probe", argv, cfg)


def test_submitit_stage_requeued_on_time_limit_and_preemption_resumes(slurm_env, tmp_path):
    cluster, run = slurm_env, tmp_path / "run"
    job = _probe_stage(tmp_path, steps=14, step_time=0.25)
    _wait_for(lambda: (run / "checkpoints" / "step_00000002").is_dir(), 90, "no checkpoint")
    job._interrupt(timeout=True)  # submitit's time-limit signal (USR2), as SLURM sends it signal_delay_s before
    _wait_for(lambda: len(_ranks(run, 0)) == 2, 60, "first attempt did not stop")
    # then a preemption of the requeued job (SLURM sends SIGTERM and requeues it itself)
    _wait_for(lambda: any(int(p.name[5:]) > _ranks(run, 0)[0]["step"] + 1
                          for p in (run / "checkpoints").glob("step_????????")), 60, "no checkpoint in attempt 2")
    subprocess.run(["scontrol", "requeue", job.job_id], env=cluster.env(), check=True)
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["world_size"] == 2 for r in results)
    a0, a1, a2 = _ranks(run, 0), _ranks(run, 1), _ranks(run, 2)
    assert all(r["preempted"] and not r["finished"] for r in a0 + a1)
    assert a1[0]["resumed_from_step"] == a0[0]["step"] and a2[0]["resumed_from_step"] == a1[0]["step"]
    assert [(r["step"], r["finished"], r["launcher"]) for r in a2] == [(14, True, "torchrun")] * 2
    assert [r["node"] for r in a2] == ["n1", "n2"]
    assert cluster.job(job.job_id)["Restarts"] == "2"
    log = "".join((tmp_path / "submitit" / job.job_id / f"{job.job_id}_0_log.{x}").read_text() for x in ("out", "err"))
    assert "Requeued job" in log  # by submitit, after the time-limit signal
    assert "probe stopped after SIGUSR2" in log and "probe stopped after SIGTERM" in log
    assert cluster.wait(job.job_id, timeout_s=30) == "COMPLETED"
    _wait_for(lambda: job.watcher.get_state(job.job_id, mode="force") == "COMPLETED", 30,
              "submitit (sacct) does not report COMPLETED")


def test_submitit_cancel_and_failure(slurm_env, tmp_path):
    import submitit

    ex = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm")
    ex.update_parameters(timeout_min=5, cpus_per_task=1, nodes=1, tasks_per_node=1)
    # functions the job can import (this test module is not importable there)
    sleeper = ex.submit(time.sleep, 300)
    failing = ex.submit(int, "boom in the job")
    with pytest.raises(submitit.core.utils.FailedJobError, match="boom in the job"):
        failing.result()
    slurm_env.wait(sleeper.job_id, states={"RUNNING"}, timeout_s=60)
    sleeper.cancel()
    assert slurm_env.wait(sleeper.job_id, timeout_s=60) == "CANCELLED"
    _wait_for(lambda: sleeper.watcher.get_state(sleeper.job_id, mode="force").startswith("CANCELLED"), 30,
              "sacct does not report CANCELLED")
    assert failing.state == "FAILED"
