"""`s2t2 submit STAGE [--config FILE] [overrides ...] [--nodes N --gpus-per-node G ...] [--wait]`: run a stage on
SLURM through submitit, requeued on preemption and time-out, resuming from the latest checkpoint.

    s2t2 submit translate --config configs/translate_olmo1b.yaml --nodes 2 --gpus-per-node 4 --time 8:00:00
    s2t2 submit finetune  --config configs/finetune_olmo7b.yaml --slurm-config my_site.yaml --wait
    python launch/submit.py evaluate --config configs/evaluate_olmo1b.yaml slurm.partition=debug --wait

Resources come, in increasing precedence, from the defaults of SlurmConfig, the `slurm:` section of the stage's
YAML, the file given by --slurm-config, `slurm.KEY=VALUE` overrides, and the explicit flags (--nodes, ...).
One task per GPU: --tasks-per-node defaults to --gpus-per-node (1 task when there are no GPUs).

Inside the job, StageJob (a submitit Checkpointable) exports the rendezvous (MASTER_ADDR: the NodeAddr of the
first node; MASTER_PORT: from the job id; RANK/WORLD_SIZE/LOCAL_RANK from submitit's JobEnvironment) and calls the
stage's `main(argv)` in-process. Preemption and time limits:
  - --signal-delay-s before the time limit (default: derived from the checkpoint's size, cluster/layout.py)
    submitit's SIGUSR2 arrives; StageJob hands it to the training loop
    (as SIGUSR1), which checkpoints at the next step boundary and returns; then submitit's own handler calls
    StageJob.checkpoint() (a DelayedSubmission of the same job) and `scontrol requeue`s the job (at most
    --max-requeues time-outs);
  - on preemption (PreemptMode=REQUEUE), `scontrol requeue` or scancel, SLURM sends SIGTERM: the loop checkpoints
    and SLURM requeues (or cancels) the job itself.
A task that stopped for a signal never returns a result (submitit would take the job for finished); the attempt
that runs to the end does, also when the signal came during its final export or after its result was written. The
stage resumes by itself from the latest checkpoint in its run directory.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


from s2t2_dist.cli import COMMANDS
from s2t2_dist.cluster.layout import SIGNAL_MARGIN_S, timeout_minutes
from s2t2_dist.errors import ConfigError
from s2t2_dist.utils import stop

#: stage name -> module with `main(argv: list[str]) -> int`: the user's stages of `s2t2 <stage>` (cli.COMMANDS, the one
#: registry) and the cluster probe
STAGES = {**{name: COMMANDS[name][0] for name in ("prepare", "translate", "finetune", "evaluate")},
          "probe": "s2t2_dist.cluster.probe"}
_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGUSR1), int(signal.SIGUSR2)}


@dataclass
class SlurmConfig:
    """Resources and scheduling of one submission (the `slurm:` section)."""

    #: nodes of the job (sbatch --nodes)
    nodes: int = 1
    #: GPUs per node; 0 for CPU jobs
    gpus_per_node: int = 0
    #: tasks (ranks) per node; 0: one per GPU (1 without GPUs)
    tasks_per_node: int = 0
    #: CPU cores per task (data loading workers and the host side of each rank)
    cpus_per_task: int = 8
    #: wall-clock limit: minutes, or [D-]HH:MM[:SS]
    time: str = "60"
    #: SLURM partition; empty: the site default
    partition: str = ""
    #: account charged for the job; empty: the user's default
    account: str = ""
    #: quality of service; empty: the site default
    qos: str = ""
    #: memory per node, e.g. 64G; empty: the site default; 0: all of it
    mem: str = ""
    #: node features required (sbatch --constraint), e.g. h100
    constraint: str = ""
    #: the job's name in the queue; empty: s2t2-STAGE
    job_name: str = ""
    #: submitit's folder (job scripts, pickles, logs); %j becomes the job id
    folder: str = "submitit/%j"
    #: how many time-outs are requeued before giving up (preemptions are always requeued)
    max_requeues: int = 20
    #: seconds between the time-limit warning and the kill (time to write the final checkpoint); 0: derived from
    #: the stage's checkpoint size at 0.5 GB/s per node x 1.5 + 120 s (s2t2_dist/cluster/layout.py), e.g. 180 s for
    #: OLMo-1B stage 1 or 2, 300 s for OLMo-7B stage 2 on 2 nodes
    signal_delay_s: int = 0
    #: extra sbatch options, e.g. {"exclusive": true, "reservation": "x"}
    additional: dict = field(default_factory=dict)
    #: shell lines run in the batch script before srun (module load ..., source venv/bin/activate)
    setup: list[str] = field(default_factory=list)
    #: extra srun arguments, e.g. ["--cpu-bind=none"]
    srun_args: list[str] = field(default_factory=list)
    #: environment variables set in every task (e.g. S2T2_DEVICE: cpu)
    env: dict = field(default_factory=dict)

    def validate(self) -> None:
        for k, lo in (("nodes", 1), ("cpus_per_task", 1), ("gpus_per_node", 0), ("tasks_per_node", 0),
                      ("max_requeues", 0), ("signal_delay_s", 0)):
            if getattr(self, k) < lo:
                raise ConfigError(f"{k}: must be >= {lo}, got {getattr(self, k)}")
        timeout_minutes(self.time)

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or max(self.gpus_per_node, 1)


# Exported once in the batch script (before srun), so no rank has to ask slurmctld: the first node's address as
# SLURM knows it (node names need not resolve) and a port every task derives from the job id (distributed/rendezvous.py,
# the one place they are computed; run by the interpreter submitit runs the job with).
RENDEZVOUS_SETUP = [f'eval "$({shlex.quote(sys.executable)} -m s2t2_dist.distributed.rendezvous)"']


class StageJob:
    """What submitit runs in every task: rendezvous from the JobEnvironment, then the stage's main() in-process.

    A submitit Checkpointable: on the time-limit signal submitit calls checkpoint(), which resubmits this same
    object (the stage resumes from its own checkpoints, so there is no state to carry)."""

    def __init__(self, stage: str, argv: list[str], env: dict | None = None, workdir: str | None = None):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; choose from {', '.join(sorted(STAGES))}")
        self.stage, self.argv = stage, list(argv)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.workdir = workdir

    def __repr__(self) -> str:
        return f"StageJob({self.stage!r}, {self.argv!r})"

    def checkpoint(self, *args: Any, **kwargs: Any):
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    # ------------------------------------------------------------------ inside the job
    def setup_environment(self) -> dict[str, str]:
        import submitit

        from s2t2_dist.distributed.rendezvous import slurm_first_host_addr, slurm_port

        job = submitit.JobEnvironment()
        os.environ.update(self.env)
        if not os.environ.get("MASTER_ADDR"):  # the batch script's setup lines normally set it
            os.environ["MASTER_ADDR"] = slurm_first_host_addr(dict(os.environ))
        if not os.environ.get("MASTER_PORT"):
            os.environ["MASTER_PORT"] = str(slurm_port(dict(os.environ)))
        per_node = max(job.num_tasks // max(job.num_nodes, 1), 1)
        rdv = {"RANK": job.global_rank, "WORLD_SIZE": job.num_tasks, "LOCAL_RANK": job.local_rank,
               "LOCAL_WORLD_SIZE": per_node, "GROUP_RANK": job.node, "NODE_RANK": job.node}
        os.environ.update({k: str(v) for k, v in rdv.items()})
        if self.workdir:
            os.chdir(self.workdir)
        return {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", *rdv)}

    def __call__(self) -> dict:
        rdv = self.setup_environment()
        main = importlib.import_module(STAGES[self.stage]).main
        submitit_usr2 = signal.getsignal(signal.SIGUSR2)

        def on_usr2(signum, frame):
            # The time-limit warning. While the training loop runs, it owns SIGUSR1/SIGTERM: hand the warning to
            # it so it checkpoints at the next step boundary; the requeue happens after main() returns.
            loop_handler = signal.getsignal(signal.SIGUSR1)
            if callable(loop_handler):
                loop_handler(signal.SIGUSR1, frame)
            elif callable(submitit_usr2):  # no loop running: submitit's default (requeue now)
                submitit_usr2(signum, frame)

        # Every signal that reaches a Python handler (the loop's, submitit's or ours) also writes its number to
        # this pipe: the only way to learn, after main() returns, that the stage stopped early for a signal.
        if threading.current_thread() is not threading.main_thread():  # e.g. submitit's "debug" executor
            rc = main(list(self.argv))
            return self._result(rc, rdv)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        old_usr2 = signal.signal(signal.SIGUSR2, on_usr2)
        try:
            rc = main(list(self.argv))
        finally:
            signal.signal(signal.SIGUSR2, old_usr2)
            signal.set_wakeup_fd(old_fd)
            try:
                seen = set(os.read(r, 65536))
            except BlockingIOError:
                seen = set()
            os.close(r)
            os.close(w)
        stops = seen & _STOP_SIGNALS
        if stops and stop.finished():  # during the final export or after the result: nothing left to resume
            return self._result(rc, rdv)
        if stops:
            names = ", ".join(signal.Signals(s).name for s in sorted(stops))
            print(f"s2t2 submit: {self.stage} stopped after {names} with a checkpoint; "
                  f"rank {rdv['RANK']} exits without a result", file=sys.stderr, flush=True)
            if {int(signal.SIGUSR1), int(signal.SIGUSR2)} & stops and callable(submitit_usr2):
                # Time limit: submitit checkpoints (resubmits this job) and requeues it from rank 0, then exits.
                submitit_usr2(signal.SIGUSR2, None)
            # SIGTERM: SLURM requeues (preemption, scontrol requeue) or ends (scancel) the job itself.
            raise SystemExit(0)
        return self._result(rc, rdv)

    def _result(self, rc, rdv: dict) -> dict:
        if rc:
            raise RuntimeError(f"stage {self.stage} exited with code {rc} on rank {rdv['RANK']}")
        return {"stage": self.stage, "rank": int(rdv["RANK"]), "world_size": int(rdv["WORLD_SIZE"]), "rc": rc or 0}


# ---------------------------------------------------------------------- submission
def build_executor(cfg: SlurmConfig, cluster: str | None = None):
    import submitit

    folder = cfg.folder
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, slurm_max_num_timeout=cfg.max_requeues)
    params: dict[str, Any] = {
        "nodes": cfg.nodes,
        "tasks_per_node": cfg.ntasks_per_node,
        "cpus_per_task": cfg.cpus_per_task,
        "timeout_min": timeout_minutes(cfg.time),
    }
    if cfg.gpus_per_node:
        params["gpus_per_node"] = cfg.gpus_per_node
    if cfg.job_name:
        params["name"] = cfg.job_name
    if executor.cluster == "slurm":
        for key in ("partition", "account", "qos", "mem", "constraint"):
            if getattr(cfg, key):
                params[f"slurm_{key}"] = str(getattr(cfg, key))
        params["slurm_signal_delay_s"] = cfg.signal_delay_s or SIGNAL_MARGIN_S  # 0 here: a probe, no checkpoint size
        params["slurm_setup"] = RENDEZVOUS_SETUP + list(cfg.setup)
        extra = {"requeue": True, **cfg.additional}
        params["slurm_additional_parameters"] = extra
        if cfg.srun_args:
            params["slurm_srun_args"] = list(cfg.srun_args)
    executor.update_parameters(**params)
    return executor


def submit_stage(stage: str, argv: list[str], cfg: SlurmConfig, cluster: str | None = None):
    """Submit `stage` with its command-line arguments; returns the submitit Job."""
    executor = build_executor(cfg, cluster)
    if not cfg.job_name:
        executor.update_parameters(name=f"s2t2-{stage}")
    return executor.submit(StageJob(stage, argv, env=cfg.env, workdir=os.getcwd()))


def _stage_config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a in ("--config", "-c") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def resolve_slurm_config(stage_argv: list[str], slurm_config: str | None, flags: dict[str, Any]
                         ) -> tuple[SlurmConfig, list[str]]:
    """SlurmConfig from (lowest first) defaults, the stage YAML's `slurm:` section, --slurm-config, slurm.* overrides,
    flags; returns it and the stage's argv without the slurm.* overrides."""
    from s2t2_dist.config import apply_overrides, config_from_dict, read_yaml

    data: dict = {}
    path = _stage_config_path(stage_argv)
    if path and Path(path).is_file():  # a missing or broken stage config is the stage's error to report
        try:
            section = read_yaml(path).get("slurm")
        except ConfigError:
            section = None
        if isinstance(section, dict):
            data.update(section)
    if slurm_config:
        if not Path(slurm_config).is_file():
            raise ConfigError(f"--slurm-config: file not found: {slurm_config}")
        loaded = read_yaml(slurm_config)
        data.update(loaded.get("slurm", loaded))
    rest = []
    slurm_overrides = []
    for a in stage_argv:
        if a.startswith("slurm.") and "=" in a:
            slurm_overrides.append(a[len("slurm."):])
        else:
            rest.append(a)
    apply_overrides(data, slurm_overrides)
    for key, value in flags.items():
        if value is not None:
            data[key] = value
    return config_from_dict(SlurmConfig, data, prefix="slurm"), rest  # errors name the key as slurm.KEY


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="s2t2 submit", allow_abbrev=False,  # the stage's options pass through
                                description="Submit a stage to SLURM with submitit; requeued on preemption and "
                                            "time-out, it resumes from its latest checkpoint.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Other arguments (--config FILE, dotted.key=value) go to the stage.")
    p.add_argument("stage", choices=sorted(STAGES))
    p.add_argument("--slurm-config", help="YAML with the SlurmConfig keys (or a `slurm:` section)")
    names = _add_slurm_flags(p)
    p.add_argument("--device", choices=["cpu", "auto"], default=None,
                   help="cpu: run the stage on CPU with gloo (sets S2T2_DEVICE=cpu in the job)")
    p.add_argument("--wait", action="store_true", help="wait for the job and print its results")
    p.add_argument("--cluster", default=None, help="submitit cluster: slurm (default when sbatch exists), local, debug")
    args, stage_argv = p.parse_known_args(argv)
    flags = {n: getattr(args, n) for n in names if hasattr(args, n)}
    from s2t2_dist.stages.common import run_main

    return run_main("s2t2 submit", lambda: _submit(args, stage_argv, flags))


def _add_slurm_flags(p: argparse.ArgumentParser) -> set[str]:
    """One flag per scalar SlurmConfig key (--gpus-per-node for gpus_per_node), its help the key's `#:` comment:
    the dataclass is the flags' one home. Returns the keys given flags (dict keys are YAML-only)."""
    from s2t2_dist.config_docs import field_docs

    docs = field_docs(SlurmConfig)
    names = set()
    for f in fields(SlurmConfig):
        typ = {int: int, str: str, "int": int, "str": str}.get(f.type)
        if typ is None:  # additional, setup: structured values, given in --slurm-config
            continue
        help_ = docs.get(f.name, "").replace("%", "%%") or None
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=typ, default=None, help=help_)
        names.add(f.name)
    return names


def check_stage_config(stage: str, argv: list[str], cfg: SlurmConfig | None = None) -> None:
    """Parse the stage's own config here, before queueing, so that a mistake is one line now and not a job that
    waits in the queue and then fails at start (ConfigError): the keys, and the batch layout on the ranks ``cfg``
    asks for. Fills in cfg.signal_delay_s (0: auto) from the size of the stage's checkpoint."""
    from s2t2_dist.cluster import layout

    if stage not in layout.STAGE_NAMES:  # the probe: its own arguments
        return
    stage_cfg = layout.parse_stage_config(stage, argv)
    if cfg is None:
        return
    world = cfg.nodes * cfg.ntasks_per_node
    layout.check_layout(stage_cfg, world, f"slurm.nodes={cfg.nodes} x slurm.tasks_per_node={cfg.ntasks_per_node} "
                                          f"= {world} ranks")
    if not cfg.signal_delay_s:
        cfg.signal_delay_s = layout.signal_lead_s(layout.checkpoint_bytes(stage, stage_cfg), cfg.nodes)
    layout.check_time_limit(60 * timeout_minutes(cfg.time), cfg.signal_delay_s,
                            f"slurm.time={cfg.time} (with slurm.signal_delay_s={cfg.signal_delay_s})")


def _submit(args, stage_argv: list[str], flags: dict) -> int:
    cfg, stage_argv = resolve_slurm_config(stage_argv, args.slurm_config, flags)
    check_stage_config(args.stage, stage_argv, cfg)
    if args.device == "cpu":
        cfg.env["S2T2_DEVICE"] = "cpu"
    job = submit_stage(args.stage, stage_argv, cfg, cluster=args.cluster)
    print(job.job_id, flush=True)
    print(f"# {args.stage}: {cfg.nodes} node(s) x {cfg.ntasks_per_node} task(s), time-limit signal "
          f"{cfg.signal_delay_s} s ahead, logs in "
          f"{job.paths.stdout.parent}; stage arguments: {shlex.join(stage_argv)}", file=sys.stderr, flush=True)
    if not args.wait:
        return 0
    try:
        results = job.results()
    except Exception as e:  # noqa: BLE001 - report and fail
        print(f"job {job.job_id} failed: {e}", file=sys.stderr)
        return 1
    print(f"job {job.job_id} finished: {results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
