"""What every stage's entry point does the same way: read the config, start distributed, pick device and
precision, create the run directory, logger and checkpointer."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from s2t2_dist.config import load_config, save_config, to_dict
from s2t2_dist.dist.env import DistEnv, device_for, init_distributed
from s2t2_dist.train.metrics import MetricsLogger

T = TypeVar("T")
log = logging.getLogger("s2t2")


def parse_args(cls: type[T], argv: list[str], prog: str, extra=None) -> tuple[T, argparse.Namespace]:
    epilog = None
    if "-h" in argv or "--help" in argv:  # every key, its type, default and description (config_docs)
        from s2t2_dist.config_docs import format_keys

        epilog = format_keys(cls, prog.split()[-1])
    p = argparse.ArgumentParser(prog=prog, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=100")
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


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "fp32" or (precision == "auto" and device.type == "cpu"):
        return torch.float32
    return torch.bfloat16


def setup(run_dir: str, precision: str, cfg, seed: int, *, record: bool = True) -> Runtime:
    """record=False: the caller writes RUN_DIR/config.yaml itself (`record_config`) once it knows the run will use
    this config (a resumed run checks its checkpoint first)."""
    logging.basicConfig(level=os.environ.get("S2T2_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s")
    env = init_distributed()
    device = device_for(env)
    if os.environ.get("S2T2_DEVICE") == "cpu":
        device = torch.device("cpu")
    torch.manual_seed(seed)
    rd = Path(run_dir)
    from s2t2_dist.stages.checks import claim_run_dir  # one run per directory (lock + owner marker)

    claim_run_dir(rd, type(cfg).__name__.removesuffix("Config").lower(), env.is_main)
    if env.is_main:
        if record:
            save_config(cfg, rd / "config.yaml")
    logger = MetricsLogger(rd / "tb", rank=env.rank, node_rank=env.node_rank, local_rank=env.local_rank)
    return Runtime(env, device, resolve_dtype(precision, device), rd, logger)


def record_config(rt: Runtime, cfg) -> None:
    """Write RUN_DIR/config.yaml: the config this run really uses (called after the resume checks passed)."""
    if rt.env.is_main:
        save_config(cfg, rt.run_dir / "config.yaml")


def fingerprint(**parts) -> dict:
    """Short hashes of what must not change between a checkpoint and the run that resumes it."""
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for k, v in parts.items()}


def config_part(cfg, *names) -> dict:
    d = to_dict(cfg)
    return {n: d[n] for n in names}


def teardown() -> None:
    from s2t2_dist.dist import collectives as coll
    from s2t2_dist.utils.rundir import release_all

    release_all()  # the run's outputs are written: its directory is free for the next run

    if coll.initialized():
        from s2t2_dist.dist.exit import destroy_process_group

        coll.barrier()
        destroy_process_group()


#: errors about the user's inputs or the run's state whose message says what is wrong (config keys and values,
#: shards and manifests, P files, initialisation, checkpoints, too many bad steps): one line, not a traceback
USER_ERRORS = ("ConfigError", "DataError", "PFileError", "InitError", "CheckpointError", "TooManyBadSteps",
               "FaultSpecError")


def is_user_error(e: BaseException) -> bool:
    return bool({c.__name__ for c in type(e).__mro__} & set(USER_ERRORS))


def report_user_error(prog: str, e: BaseException) -> int:
    """Print a user error as one line `[rank R] prog: error: Type: message` on stderr; returns the exit code 2."""
    import sys

    world = os.environ.get("WORLD_SIZE", "1")
    where = f"[rank {os.environ.get('RANK', '?')}] " if world not in ("", "1") else ""
    msg = " ".join(str(e).split("\n"))  # one line, whatever the message holds
    print(f"{where}{prog}: error: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
    return 2


def run_main(prog: str, fn: Callable[[], Any]) -> int:
    """Run an entry point (every stage, evaluate and submit included). A user error (USER_ERRORS, by class name, so
    that the check imports nothing) is printed as one line (`report_user_error`) and gives exit code 2; anything
    else (a bug) keeps its traceback. S2T2_TRACEBACK=1 shows the traceback of every error. The exit code is fn's
    when it returns an int, else 0."""
    from s2t2_dist.utils.rundir import release_all

    try:
        rc = fn()
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which checkpoints on the first one), or twice
        if os.environ.get("S2T2_TRACEBACK"):
            raise
        import sys

        print(f"{prog}: interrupted (Ctrl-C); a run resumes from its last checkpoint", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a user error
        if os.environ.get("S2T2_TRACEBACK") or not is_user_error(e):
            raise
        return report_user_error(prog, e)
    finally:
        release_all()  # an entry point run in-process (tests, recipes) leaves no directory locked behind
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
