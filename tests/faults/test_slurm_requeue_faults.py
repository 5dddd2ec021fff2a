"""Stage 1 under a REAL SLURM cluster through submitit (2 nodes x 1 task, CPU): the time-limit warning (submitit's
USR2, handed to the loop) and a preemption (`scontrol requeue`: SIGTERM to the step, SLURM requeues) each make the
job checkpoint at a step boundary, exit cleanly and come back as a requeued attempt that resumes; the final result
is exactly the uninterrupted run's (losses of every step, samples, P). Skipped without the SLURM packages (CI
installs them: .ci/install_slurm.sh), as tests/cluster/test_slurm_cluster.py."""

from __future__ import annotations

import json
import os
import time

import pytest
from tests.helpers.faults_suite import REPO, TRANSLATE_STEPS, ledger, translate_args

from s2t2_dist.translator.pfile import load_p
from s2t2_dist import faults

pytestmark = [pytest.mark.faults, pytest.mark.slurm]


@pytest.fixture(scope="module")
def cluster():
    from tests.helpers.slurm_cluster import LocalSlurmCluster, require_packages

    require_packages(accounting=True)
    c = LocalSlurmCluster(nodes=2, cpus_per_node=4, gpus_per_node=0, keep_root=bool(os.environ.get("S2T2_KEEP_SLURM")))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(what)


def _last_step(trace, rank=0) -> int:
    ev = faults.read_trace(trace, rank)
    starts = [e["pid"] for e in ev if e["ev"] == "start"]
    return max([e["step"] for e in ev if e["ev"] == "step" and starts and e["pid"] == starts[-1]], default=-1)


def test_submitit_time_limit_and_preemption_lose_nothing(cluster, translate_reference, tiny_data, stories, tmp_path,
                                                         monkeypatch, rng):
    import subprocess

    from s2t2_dist.cluster.submit import SlurmConfig, submit_stage

    for k in list(os.environ):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.chdir(REPO)
    ref_run, ref_hist = translate_reference
    run, trace = tmp_path / "run", tmp_path / "trace"
    cfg = SlurmConfig(nodes=2, tasks_per_node=1, cpus_per_task=1, time="10", folder=str(tmp_path / "submitit/%j"),
                      signal_delay_s=30, env={"S2T2_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "S2T2_LOG_LEVEL": "WARNING",
                                              "TOKENIZERS_PARALLELISM": "false", faults.TRACE_ENV: str(trace)})
    job = submit_stage("translate", translate_args(tiny_data, stories, run, f"train.steps={TRANSLATE_STEPS}"), cfg)
    n_starts = lambda: sum(e["ev"] == "start" for e in faults.read_trace(trace, 0))  # noqa: E731 - a one-line closure

    # attempt 1: the time-limit warning (submitit's USR2) at a random step
    first = rng.randint(3, 9)
    _wait_for(lambda: _last_step(trace) >= first, 240, f"attempt 1 did not reach step {first}")
    job._interrupt(timeout=True)
    # attempt 2 (requeued by submitit): preempted by `scontrol requeue` (SIGTERM, SLURM requeues it)
    _wait_for(lambda: n_starts() >= 2, 240, "the job was not requeued after the time-limit signal")
    second = json.loads((run / "result.json").read_text())["step"] + rng.randint(2, 6)
    _wait_for(lambda: _last_step(trace) >= second, 240, f"attempt 2 did not reach step {second}")
    subprocess.run(["scontrol", "requeue", job.job_id], env=cluster.env(), check=True)
    results = job.results()  # attempt 3 runs to the end
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["world_size"] == 2 for r in results)
    assert cluster.job(job.job_id)["Restarts"] == "2"
    log = "".join((tmp_path / "submitit" / job.job_id / f"{job.job_id}_0_log.{x}").read_text() for x in ("out", "err"))
    assert "translate stopped after SIGUSR2" in log and "translate stopped after SIGTERM" in log, log[-3000:]

    for r in (0, 1):
        h = faults.effective_history(faults.read_trace(trace, r))
        assert len(h["starts"]) == 3 and h["starts"][1][1] >= first and h["starts"][2][1] >= second, h["starts"]
        assert h["starts"][1][1] in h["complete"] or r == 1
        assert h["losses"] == ref_hist[r]["losses"], (r, rng.seed_value)
        assert h["batches"] == ref_hist[r]["batches"], (r, rng.seed_value)
    # one run per directory: each requeued attempt took run_dir's lock after the previous attempt died; the
    # lock file names the last holder, attempt 3's rank 0 (rank 1 on the other node never held it)
    holder = json.loads((run / ".s2t2.lock").read_text())
    starts = faults.effective_history(faults.read_trace(trace, 0))["starts"]
    assert holder["slurm_job"] == job.job_id and holder["pid"] == starts[-1][0] and holder["stage"] == "translate"
    a, b = load_p(ref_run / "P.safetensors"), load_p(run / "P.safetensors")
    assert a.indices.equal(b.indices) and a.values.equal(b.values)
    ledger("translate under SLURM+submitit: time-limit signal (USR2), checkpoint, submitit requeue", step=first)
    ledger("translate under SLURM+submitit: preemption (scontrol requeue: SIGTERM), checkpoint, requeue",
           step=second)
