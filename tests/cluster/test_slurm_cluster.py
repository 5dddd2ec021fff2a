"""The launch layer against a REAL SLURM cluster started for this module: munged, MariaDB + slurmdbd (accounting),
slurmctld and two slurmd nodes n1, n2 on this host (tests.helpers.slurm_cluster).

Jobs run on CPU with gloo: the real stage 1 entry (launch/translate.py, once the stage code is in the tree) and the
stand-in entry point `python -m s2t2_dist.cluster.probe` (rendezvous, all-reduce, the shared training loop with
checkpoints, TensorBoard), through the real slurm/*.sh scripts and through submitit. The batch jobs that need no
interaction are submitted together at the start and checked at the end, so they run while the other tests wait.
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

from s2t2_dist.distributed.rendezvous import job_port
from tests.helpers.slurm_cluster import LocalSlurmCluster, require_packages

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    require_packages(accounting=True)
    # its own folder under /tmp (pytest's tmp folders are private to root: munged and MariaDB refuse them);
    # removed at the end unless S2T2_KEEP_SLURM=1 (to read the daemons' logs)
    # 8 CPUs and 8 fake GPUs declared per node (more than the host has) so that several jobs run at once
    c = LocalSlurmCluster(nodes=2, cpus_per_node=8, gpus_per_node=8,
                          keep_root=bool(os.environ.get("S2T2_KEEP_SLURM")))
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
    return {"S2T2_HOME": str(REPO), "S2T2_PYTHON": sys.executable, "S2T2_ENTRY": "-m s2t2_dist.cluster.probe",
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


class BatchJobs:
    """The batch jobs that need no interaction, submitted together when the first test starts so they run while
    the interactive tests (signals, requeues) wait; each is checked by its own test at the end. A job is submitted
    on first use, so running one test (-k) submits only its job."""

    def __init__(self, cluster: LocalSlurmCluster, root: Path, request):
        self.cluster, self.root, self.request = cluster, root, request
        self.jobs: dict[str, tuple[str, Path]] = {}
        self.skipped: dict[str, str] = {}

    def start_all(self) -> None:
        for name in ("probe_2x2", "deepspeed", "translate", "shipped"):
            try:
                self.get(name)
            except pytest.skip.Exception as e:
                self.skipped[name] = str(e)

    def get(self, name: str) -> tuple[str, Path]:
        if name in self.skipped:
            pytest.skip(self.skipped[name])
        if name not in self.jobs:
            d = self.root / name
            d.mkdir()
            self.jobs[name] = (getattr(self, "_" + name)(d), d)
        return self.jobs[name]

    # --time=10 in the script jobs: the headers' time-limit warning comes 180 s (translate_1b.sh) and 480 s
    # (finetune_7b.sh) before the limit, so a shorter limit would signal (and requeue) the job as it starts
    def _probe_2x2(self, d: Path) -> str:
        return self.cluster.sbatch(
            REPO / "slurm" / "translate_1b.sh", "--out", str(d / "run"), "--steps", "4",
            sbatch_args=["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=10"],
            env=_script_env(), cwd=d)

    def _deepspeed(self, d: Path) -> str:
        env = _script_env(S2T2_LAUNCHER="deepspeed", DS_ACCELERATOR="cpu",
                          PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        return self.cluster.sbatch(
            REPO / "slurm" / "finetune_7b.sh", "--out", str(d / "run"), "--steps", "2",
            sbatch_args=["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=10"],
            env=env, cwd=d)

    def _translate(self, d: Path) -> str:
        data, model = self.request.getfixturevalue("translate_inputs")
        overrides = [f"run_dir={d / 'run'}", f"model.path={model}", f"data.train={data}/shards/new/train",
                     f"data.eval={data}/shards/new/eval", f"data.tokenizer={data}/tokenizer", "data.num_workers=0",
                     "train.context_len=64", "train.batch_size=4", "train.micro_batch_size=2", "train.steps=4",
                     "train.log_every=2", "train.ckpt_every=2", "train.eval_max_docs=4",
                     "translator.heatmap=[32,16]"]
        env = _script_env(S2T2_CONFIG=str(REPO / "configs" / "translate_olmo1b.yaml"), OMP_NUM_THREADS="1",
                          TOKENIZERS_PARALLELISM="false")
        del env["S2T2_ENTRY"]  # the script's own default: launch/translate.py
        return self.cluster.sbatch(
            REPO / "slurm" / "translate_1b.sh", *overrides,
            sbatch_args=["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=10"],
            env=env, cwd=d)


    def _shipped(self, d: Path) -> dict[str, str]:
        """Every shipped script with every shipped config, submitted as a user would from the repository root (here
        a folder whose configs/ is the repository's): the configs' own relative paths (data/raw, data/uniref50,
        runs/...) chain the stages, with afterok dependencies. Overridden: the model (tiny OLMo-1B/7B-config models,
        tiny.py), sizes (context 64, vocabularies), step counts, and the layouts (1 and 2 nodes)."""
        import gzip

        from tests.helpers.finetune_fixtures import FASTA, sample_fasta, save_model

        (d / "configs").symlink_to(REPO / "configs")
        raw = d / "data" / "raw"
        (raw / "docs").mkdir(parents=True)
        fasta = sample_fasta(FASTA, d / "sample.fasta", 160)
        (raw / "uniref50.fasta.gz").write_bytes(gzip.compress(fasta.read_bytes()))
        text = (REPO / "s2t2_dist" / "assets" / "english" / "tinyshakespeare_head.txt").read_text()
        docs = [json.dumps({"text": p}) for p in text.split("\n\n") if p.strip()]
        (raw / "docs" / "part-0.jsonl.gz").write_bytes(gzip.compress(("\n".join(docs) + "\n").encode()))
        m1 = save_model(d / "models" / "olmo-1b", "olmo-1b", 32, 0)
        m7 = save_model(d / "models" / "olmo-7b", "olmo-7b", 48, 1)
        env = _script_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")
        del env["S2T2_ENTRY"]  # the scripts' own entry points: launch/<stage>.py
        one, two = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2"], ["--nodes=2", "--ntasks-per-node=1",
                                                                            "--gpus-per-node=1"]
        common = ["--cpus-per-task=1", "--time=10", "--kill-on-invalid-dep=yes"]
        ds = "engine.ds_overrides.zero_optimization.stage3_param_persistence_threshold=0"
        small = ["train.context_len=64", "train.steps=2"]
        olmo = "s2t2_dist/assets/olmo/allenai_gpt-neox-olmo-dolma-v1_5.json"

        def sub(script, *args, after=None, sb=(), **extra_env):
            dep = [f"--dependency=afterok:{after}"] if after else []
            return self.cluster.sbatch(REPO / "slurm" / script, *args, sbatch_args=[*sb, *common, *dep],
                                       env={**env, **extra_env}, cwd=d)

        jobs = {}
        jobs["prepare"] = sub("prepare_data.sh", f"source_tokenizer={REPO / olmo}", "vocab_size=64", "context_len=64",
                              "eval_fraction=0.15")
        jobs["prepare_text"] = sub("prepare_data.sh", "--config", "configs/prepare_text.yaml", "vocab_size=300")
        jobs["translate"] = sub("translate_1b.sh", f"model.path={m1}", *small, after=jobs["prepare"], sb=one)
        jobs["finetune_7b"] = sub("finetune_7b.sh", f"model.path={m7}", *small, ds, after=jobs["translate"], sb=two)
        jobs["finetune_1b"] = sub("finetune_7b.sh", f"model.path={m1}", *small, ds, after=jobs["translate"], sb=one,
                                  S2T2_CONFIG="configs/finetune_olmo1b.yaml")
        jobs["evaluate"] = sub("evaluate.sh", "eval.context_len=64", after=jobs["finetune_1b"])
        # transfer without finetuning: the 1B P on the 7B-config model, ZeRO-3, 2 nodes
        jobs["transfer"] = sub("evaluate.sh", "--config", "configs/evaluate_transfer_7b.yaml", f"model.path={m7}",
                               "eval.context_len=64", ds, after=jobs["translate"], sb=two)
        # 3 ranks cannot split the batch of 16: refused in the batch shell before any rank starts
        jobs["bad_layout"] = sub("translate_1b.sh", f"model.path={m1}",
                                 sb=["--nodes=1", "--ntasks-per-node=3", "--gpus-per-node=3"])
        return jobs


@pytest.fixture(scope="module")
def batch_jobs(cluster, tmp_path_factory, request):
    return BatchJobs(cluster, tmp_path_factory.mktemp("batch_jobs"), request)


@pytest.fixture(scope="module")
def translate_inputs(tmp_path_factory):
    """Prepared protein shards + a tiny pretrained LM (the stage tests' real inputs); skipped on a tree without
    the stage code."""
    for mod in ("s2t2_dist.stages.translate", "s2t2_dist.translator", "s2t2_dist.recipes.llama2c"):
        pytest.importorskip(mod, reason="stage 1 code not in this tree")
    stage_fixtures = pytest.importorskip("tests.helpers.stage_fixtures",
                                         reason="tests/helpers/stage_fixtures.py not in this tree")
    return stage_fixtures.small_inputs(tmp_path_factory)


def test_cluster_has_two_nodes_and_accounting(cluster, batch_jobs):
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t %c %G"], env=cluster.env(),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert sorted(line.split()[0] for line in out if line) == ["n1", "n2"]
    assert all(" idle 8 gpu:8" in line for line in out if line), out
    assert cluster.node_addr("n2") == "127.0.0.1"
    assert set(cluster.running()) == {"munged", "mariadb", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2"}
    res = subprocess.run(["sacct", "-n", "-X"], env=cluster.env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    batch_jobs.start_all()  # the non-interactive jobs run while the next tests wait on signals and requeues


def test_sbatch_time_limit_warning_checkpoints_requeues_and_resumes(cluster, tmp_path):
    run = tmp_path / "run"
    job = cluster.sbatch(REPO / "slurm" / "translate_1b.sh", "--out", str(run), "--steps", "20",
                         "--step-time", "0.3", "--ckpt-every", "2",
                         sbatch_args=["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1",
                                      "--time=10"],
                         env=_script_env(), cwd=tmp_path)
    _wait_for(lambda: (run / "checkpoints" / "step_00000002").is_dir(), 90, "no checkpoint")
    # what SLURM does 120 s before the time limit (--signal=B:USR1@120): signal the batch shell only
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env(), check=True)
    state = cluster.wait(job, timeout_s=150)
    log = (tmp_path / f"s2t2-translate-1b-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert cluster.job(job)["Restarts"] == "1"
    assert "requeueing (restart 1)" in log and "restart=1" in log
    first, second = _ranks(run, 0), _ranks(run, 1)
    assert [r["preempted"] for r in first] == [True, True] and not any(r["finished"] for r in first)
    stopped_at = first[0]["step"]
    assert 2 <= stopped_at < 20
    assert [(r["resumed_from_step"], r["step"], r["finished"]) for r in second] == [(stopped_at, 20, True)] * 2
    states = [r["State"] for r in cluster.wait_sacct(job, "COMPLETED") if r["JobID"] == job]
    assert states == ["REQUEUED", "COMPLETED"]
    # TensorBoard keeps one value per step across the two attempts
    g, _ = _scalars(run / "tb" / "global")
    assert [s for s, _ in g["train/loss"]] == list(range(1, 21))


def _probe_stage(tmp_path: Path, steps: int, step_time: float, nodes: int = 2):
    from s2t2_dist.cluster.submit import SlurmConfig, submit_stage

    cfg = SlurmConfig(nodes=nodes, tasks_per_node=1, cpus_per_task=1, time="5", folder=str(tmp_path / "submitit/%j"),
                      env={"S2T2_DEVICE": "cpu"}, signal_delay_s=30)
    argv = ["--out", str(tmp_path / "run"), "--steps", str(steps), "--step-time", str(step_time)]
    return submit_stage("probe", argv, cfg)


def test_submitit_stage_requeued_on_time_limit_and_preemption_resumes(slurm_env, tmp_path):
    cluster, run = slurm_env, tmp_path / "run"
    job = _probe_stage(tmp_path, steps=24, step_time=0.3)
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
    assert [(r["step"], r["finished"], r["launcher"]) for r in a2] == [(24, True, "torchrun")] * 2
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


def test_sbatch_translate_script_spreads_ranks_and_logs_every_node(cluster, batch_jobs):
    job, d = batch_jobs.get("probe_2x2")
    run = d / "run"
    state = cluster.wait(job, timeout_s=180)
    log = (d / f"s2t2-translate-1b-{job}.out").read_text()
    assert state == "COMPLETED", log
    ranks = _ranks(run, 0)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    port = job_port({"SLURM_JOB_ID": job})
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


def test_sbatch_translate_1b_runs_stage_1_on_two_nodes(cluster, batch_jobs):
    """The real entry (launch/translate.py) through slurm/translate_1b.sh: 2 nodes x 1 task, CPU, gloo."""
    job, d = batch_jobs.get("translate")
    run = d / "run"
    state = cluster.wait(job, timeout_s=240)
    log = (d / f"s2t2-translate-1b-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "launch/translate.py --config" in log
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] and result["step"] == 4 and (run / "P.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert json.loads((run / "checkpoints" / "step_00000004" / "meta.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (run / "tb").iterdir()) == ["global", "node_000", "node_001"]
    g, tags = _scalars(run / "tb" / "global")
    assert [s for s, _ in g["train/loss"]] == [2, 4] and "P/density" in g
    assert "P/heatmap" in tags["images"] and any("top_translations" in t for t in tags["tensors"])
    for node in ("node_000", "node_001"):
        assert [s for s, _ in _scalars(run / "tb" / node)[0]["node/tokens_per_s"]] == [2, 4]


@pytest.mark.slow
def test_sbatch_finetune_script_with_deepspeed_launchers(cluster, batch_jobs):
    """S2T2_LAUNCHER=deepspeed: one `deepspeed` launcher per node, each starting that node's 2 ranks."""
    job, d = batch_jobs.get("deepspeed")
    run = d / "run"
    state = cluster.wait(job, timeout_s=240)
    log = (d / f"s2t2-finetune-7b-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "deepspeed --no_ssh --num_nodes 2 --num_gpus 2 --module s2t2_dist.cluster.probe" in log
    ranks = _ranks(run, 0)
    assert [(r["rank"], r["node"], r["node_rank"], r["local_rank"], r["local_world_size"]) for r in ranks] == \
        [(0, "n1", 0, 0, 2), (1, "n1", 0, 1, 2), (2, "n2", 1, 0, 2), (3, "n2", 1, 1, 2)]
    assert all(r["launcher"] == "deepspeed" and r["allreduce_sum"] == 10.0 and r["finished"] for r in ranks)
    assert sorted(p.name for p in (run / "tb").iterdir()) == ["global", "node_000", "node_001"]


def _log(d: Path, name: str, job: str) -> str:
    f = d / f"{name}-{job}.out"
    return f.read_text() if f.is_file() else f"(no {f.name})"


@pytest.mark.slow
def test_every_shipped_script_runs_its_shipped_config_through_the_stages(cluster, batch_jobs):
    """prepare_data.sh (prepare_uniref50.yaml, prepare_text.yaml) -> translate_1b.sh (translate_olmo1b.yaml, 1 node x
    2) -> finetune_7b.sh (finetune_olmo7b.yaml on 2 nodes x 1, ZeRO-3; finetune_olmo1b.yaml on 1 node x 2) and
    evaluate.sh (evaluate_transfer_7b.yaml, 2 nodes x 1, ZeRO-3) -> evaluate.sh (evaluate_olmo1b.yaml on the 1B
    export): every shipped config, each with its own relative paths, as typed."""
    jobs, d = batch_jobs.get("shipped")
    names = {"prepare": "s2t2-prepare", "prepare_text": "s2t2-prepare", "translate": "s2t2-translate-1b",
             "finetune_7b": "s2t2-finetune-7b", "finetune_1b": "s2t2-finetune-7b", "evaluate": "s2t2-evaluate",
             "transfer": "s2t2-evaluate"}
    for key in ("prepare", "prepare_text", "translate", "finetune_7b", "finetune_1b", "evaluate", "transfer"):
        state = cluster.wait(jobs[key], timeout_s=420)
        assert state == "COMPLETED", (key, _log(d, names[key], jobs[key])[-6000:])
    assert (d / "data" / "uniref50" / "tokenizer" / "tokenizer.json").is_file()
    assert (d / "data" / "uniref50" / "shards" / "source" / "train").is_dir()
    assert (d / "data" / "text_bpe8k" / "tokenizer" / "tokenizer.json").is_file()
    log = _log(d, "s2t2-prepare", jobs["prepare"])
    assert "layout: --nodes=1 x --ntasks-per-node=1 = 1 ranks; the final checkpoint needs the time-limit signal 120 s" \
        in log
    tr = json.loads((d / "runs" / "translate_olmo1b" / "result.json").read_text())
    assert tr["finished"] and tr["step"] == 2 and (d / "runs" / "translate_olmo1b" / "P.safetensors").is_file()
    # micro_batch_size auto: batch 16 on 2 ranks of 64-token sequences = 8 per rank, no accumulation
    assert "train.batch_size=16 = micro-batch 8 x 1 accumulation step(s) x 2 ranks" in \
        _log(d, "s2t2-translate-1b", jobs["translate"])
    for run, engine in (("finetune_olmo7b_from_1b", "deepspeed"), ("finetune_olmo1b", "deepspeed")):
        r = json.loads((d / "runs" / run / "result.json").read_text())
        assert r["finished"] and r["step"] == 2 and r["world_size"] == 2 and r["engine"] == engine, run
        assert (d / "runs" / run / "final" / "config.json").is_file()
    assert {"JobID": jobs["finetune_7b"], "State": "COMPLETED", "NodeList": "n[1-2]", "ExitCode": "0:0"} in \
        cluster.wait_sacct(jobs["finetune_7b"], "COMPLETED")
    ev = json.loads((d / "runs" / "evaluate_olmo1b" / "eval.json").read_text())
    assert ev["metrics"]["docs"] > 0 and ev["metrics"]["bpb"] > 0
    tf = json.loads((d / "runs" / "evaluate_transfer_7b" / "eval_s2t2_transfer.json").read_text())
    assert tf["world_size"] == 2 and tf["engine"] == "deepspeed" and tf["metrics"]["docs"] == ev["metrics"]["docs"]


@pytest.mark.slow
def test_sbatch_script_refuses_an_impossible_layout_before_any_rank_starts(cluster, batch_jobs):
    jobs, d = batch_jobs.get("shipped")
    job = jobs["bad_layout"]
    assert cluster.wait(job, timeout_s=120) == "FAILED"
    log = _log(d, "s2t2-translate-1b", job)
    errors = [ln for ln in log.splitlines() if "error" in ln.lower()]
    assert errors == ["s2t2 layout: error: ConfigError: train.batch_size=16 is not a multiple of the ranks "
                      "(--nodes=1 x --ntasks-per-node=3 = 3 ranks), whatever train.micro_batch_size: impossible "
                      "layout; change train.batch_size or the number of ranks"], log
    assert "srun" not in log  # no job step: no rank started
    assert cluster.job(job)["ExitCode"] == "2:0"
