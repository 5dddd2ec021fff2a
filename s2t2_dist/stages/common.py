"""What every stage's entry point does the same way: read the command line (launcher arguments included), and
`run_stage`, the one skeleton of a stage's run: pre-flight, the engine's distributed start, setup (rank, device,
precision, run directory, logger), the stage's work, its result written by rank 0, teardown."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Callable

import torch

from s2t2_dist import envvars
from s2t2_dist.config import load_config, save_config, to_dict
from s2t2_dist.distributed.env import DistEnv, detect, device_for, init_distributed
from s2t2_dist.train.metrics import MetricsLogger

T = TypeVar("T")
log = logging.getLogger("s2t2")


def parse_args(cls: type[T], argv: list[str], prog: str, extra=None) -> tuple[T, argparse.Namespace]:
    """`--config FILE dotted.key=value ...`; a config with an `engine:` section also takes the launchers' arguments
    (engines/launcher.py: `--ds_config PATH` selects engine.kind=deepspeed)."""
    if any(f.name == "engine" for f in dataclasses.fields(cls)):
        from s2t2_dist.engines.launcher import engine_overrides

        argv = engine_overrides(argv)
    epilog = None
    if "-h" in argv or "--help" in argv:  # every key, its type, default and description (config_docs)
        from s2t2_dist.config_docs import format_keys

        epilog = format_keys(cls, prog.split()[-1])
    p = argparse.ArgumentParser(prog=prog, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=100")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs and results are unchanged)")
    if extra is not None:
        extra(p)
    args, unknown = p.parse_known_args(argv)
    # The deepspeed launcher appends --local_rank=N; torchrun-style env vars carry the same facts.
    unknown = [u for u in unknown if not u.startswith("--local_rank")]
    overrides = list(args.overrides) + [u.lstrip("-") for u in unknown if "=" in u]
    bad = [u for u in unknown if "=" not in u and not u.startswith("--local_rank")]
    if bad:
        p.error(f"unrecognised arguments: {' '.join(bad)}")
    return load_config(cls, args.config, overrides), args


@dataclass
class Runtime:
    env: DistEnv
    device: torch.device
    dtype: torch.dtype
    run_dir: Path
    logger: MetricsLogger
    progress: bool = True  # progress bars (rank 0); `--no-progress` turns them off


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """train.precision / eval.precision (auto: bf16 on GPU, fp32 on CPU; fp32; bf16) on `device`."""
    if precision == "fp32" or (precision == "auto" and device.type == "cpu"):
        return torch.float32
    return torch.bfloat16


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 matrix products in hardware (oneDNN's bf16 path: AVX-512 or AMX). Without them
    torch emulates bf16, and a step is many times slower than in fp32 (~15x for SmolLM2-135M on an AVX2 CPU)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: nothing computes bf16 natively
        return False


def warn_emulated_bf16(key: str, dtype: torch.dtype, device: torch.device) -> bool:
    """One warning (and True) when `key` asks for bf16 on a CPU that only emulates it: the run is correct but slow,
    and fp32 is the faster choice there."""
    if dtype != torch.bfloat16 or device.type != "cpu" or cpu_computes_bf16():
        return False
    logging.getLogger("s2t2.precision").warning(
        "%s=bf16 on a CPU without bf16 in hardware (%s, no AVX-512 / AMX bf16): torch emulates it, each step many "
        "times slower than fp32 (%s=fp32, or auto, is the fast choice here)", key,
        torch.backends.cpu.get_cpu_capability(), key)
    return True


def setup(run_dir: str, precision: str, cfg, seed: int, *, record: bool = True) -> Runtime:
    """record=False: the caller writes RUN_DIR/config.yaml itself (`record_config`) once it knows the run will use
    this config (a resumed run checks its checkpoint first)."""
    envvars.setup_logging()
    env = init_distributed()
    device = device_for(env)
    if envvars.get("S2T2_DEVICE") == "cpu":
        device = torch.device("cpu")
    torch.manual_seed(seed)
    rd = Path(run_dir)
    from s2t2_dist.stages.checks import claim_run_dir  # one run per directory (lock + owner marker)

    claim_run_dir(rd, type(cfg).__name__.removesuffix("Config").lower(), env.is_main)
    if env.is_main:
        if record:
            save_config(cfg, rd / "config.yaml")
    logger = MetricsLogger(rd / "tb", rank=env.rank, node_rank=env.node_rank, local_rank=env.local_rank)
    dtype = compute_dtype(precision, device)
    if env.is_main:
        warn_emulated_bf16("train.precision" if hasattr(cfg, "train") else "eval.precision", dtype, device)
    return Runtime(env, device, dtype, rd, logger)


def record_config(rt: Runtime, cfg) -> None:
    """Write RUN_DIR/config.yaml: the config this run really uses (called after the resume checks passed)."""
    if rt.env.is_main:
        save_config(cfg, rt.run_dir / "config.yaml")


def fingerprint(**parts) -> dict:
    """Short hashes of what must not change between a checkpoint and the run that resumes it."""
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for k, v in parts.items()}


def quiet_library_bars() -> None:
    """transformers' and huggingface_hub's own bars (Loading weights, Writing model shards) off too: `--no-progress`
    and ranks other than 0 mean no bar at all, not only none of the stage's."""
    import sys

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when they are imported
    if "transformers" in sys.modules:  # already imported: switched off where it keeps the setting
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def config_part(cfg, *names) -> dict:
    d = to_dict(cfg)
    return {n: d[n] for n in names}


def run_stage(cfg, work: Callable[[Any, Runtime, Any], dict], *, preflight: Callable[[Any], Any], precision: str,
              seed: int, result: Callable[[Runtime], Path], engine=None, record: bool = True,
              report: Callable[[Runtime, dict], None] | None = None, progress: bool = True) -> dict:
    """The skeleton of every stage's run: `preflight(cfg)` (files only, nothing started; it returns what it
    read), the engine kind's distributed start (`engine`: the config's engine section), `setup` (record: write
    config.yaml now; else the work calls `record_config` once its resume checks passed), `work(cfg, rt, found)`
    (``found``: what pre-flight read, so that the run reads each input once) -> the result dict, written
    atomically by rank 0 to `result(rt)` and then shown by `report(rt, result)`, the logger closed, teardown."""
    import s2t2_dist.train.phases as phases
    from s2t2_dist.utils import stop
    from s2t2_dist.utils.io import atomic_write_text

    envvars.setup_logging()
    startup = phases.reset()  # each start-up phase logged as it ends, kept in the result (train/phases.py)
    with startup.phase("preflight"):
        found = preflight(cfg)
    with startup.phase("process group"):
        if engine is not None:
            from s2t2_dist.engines.build import engine_kind

            engine_kind(engine.kind).init_distributed()
        rt = setup(cfg.run_dir, precision, cfg, seed, record=record)
    rt.progress = progress
    if not (progress and rt.env.is_main):
        quiet_library_bars()
    out = work(cfg, rt, found)
    out.setdefault("startup", startup.summary())
    if rt.env.is_main:
        from s2t2_dist.utils.rundir import verify

        with stop.deferred():  # the run's last output: a time-limit signal lets it complete
            verify(rt.run_dir, before="writing its result")  # still this run's directory (lock and owner marker)
            atomic_write_text(result(rt), json.dumps(out, indent=1))
    if out.get("finished", True):  # not a training run stopped with a checkpoint: nothing is left to do
        stop.finish()
    if rt.env.is_main and report is not None:
        report(rt, out)
    rt.logger.close()
    teardown()
    return out


def teardown() -> None:
    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.utils.rundir import release_all

    release_all()  # the run's outputs are written: its directory is free for the next run

    if coll.initialized():
        from s2t2_dist.distributed.exit import destroy_process_group

        coll.barrier()
        destroy_process_group()


def is_user_error(e: BaseException) -> bool:
    """An error about the user's inputs or the run's state (s2t2_dist/errors.py): one line, not a traceback."""
    from s2t2_dist.errors import UserError

    return isinstance(e, UserError)


def report_user_error(prog: str, e: BaseException) -> int:
    """Print a user error as one line `[rank R] prog: error: Type: message` on stderr; returns the exit code 2."""
    import sys

    world = os.environ.get("WORLD_SIZE", "1")
    where = f"[rank {os.environ.get('RANK', '?')}] " if world not in ("", "1") else ""
    msg = " ".join(str(e).split("\n"))  # one line, whatever the message holds
    print(f"{where}{prog}: error: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
    return 2


def run_main(prog: str, fn: Callable[[], Any]) -> int:
    """Run an entry point (every stage, evaluate and submit included). A user error (a subclass of
    errors.UserError) is printed as one line (`report_user_error`) and gives exit code 2; anything else (a bug)
    keeps its traceback. S2T2_TRACEBACK=1 shows the traceback of every error. The exit code is fn's
    when it returns an int, else 0."""
    from s2t2_dist.utils import stop
    from s2t2_dist.utils.rundir import release_all

    stop.reset()  # an earlier entry point run in this process (tests, recipes) leaves nothing behind
    try:
        with stop.installed():  # SIGTERM/SIGUSR1 from the start, before any model is loaded (utils/stop.py)
            envvars.check()  # every S2T2_* variable, before any work: a bad one is a user error like a bad key
            rc = fn()
        # run_stage judged it (a training run stopped with a checkpoint is not); a stage without it (prepare)
        # returns when its work is done
        done = stop.finished() or not isinstance(rc, dict)
        if done:
            stop.tell_launcher(detect().is_main)
        if stop.requested() is not None:  # remembered, not raised: during the final export or after the result
            import sys

            sig = stop.name(stop.requested())
            print(f"{prog}: {sig} " + ("arrived after the run's result was written; the run is finished"
                                       if stop.arrived_late() else
                                       "arrived during the final export; the export completed and the run is "
                                       "finished" if done else
                                       "arrived while the result was written; the run resumes from its last "
                                       "checkpoint"), file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which checkpoints on the first one), or twice
        if envvars.traceback_wanted():
            raise
        import sys

        print(f"{prog}: interrupted (Ctrl-C); a run resumes from its last checkpoint", file=sys.stderr, flush=True)
        return 130
    except stop.Stopped as s:  # before the first step: nothing was being written; exit 0 so the job is requeued
        import sys

        print(f"{prog}: stopped by {stop.name(s.signum)} outside the training steps (start-up, model loading); "
              "nothing was being written: a requeued or repeated run resumes from the last checkpoint",
              file=sys.stderr, flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a user error
        if envvars.traceback_wanted() or not is_user_error(e):
            raise
        return report_user_error(prog, e)
    finally:
        release_all()  # an entry point run in-process (tests, recipes) leaves no directory locked behind
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
