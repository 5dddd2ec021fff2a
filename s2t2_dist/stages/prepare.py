"""`s2t2 prepare`: split the input, train the target-domain BPE, write the train/eval shards.

    python launch/prepare.py --config configs/prepare_uniref50.yaml [num_workers=16 ...]
    s2t2 prepare --config configs/prepare_demo.yaml output_dir=/tmp/s2t2_demo      # the shipped sample, seconds

Keys: `s2t2_dist.data.config.DataConfig`. With `source_tokenizer` set, the same splits are also written with the
source model's tokenizer (shards/source/...: the original-tokenizer finetuning baseline) and the compression report
compares both tokenizers. Layout and resuming: `s2t2_dist.data.pipeline`. Re-running a finished command does no work.

Preparation is one process plus `num_workers` tokenizer processes. Started by a multi-process launcher (torchrun,
srun), only rank 0 works and shows progress bars; the other ranks return at once.
"""

from __future__ import annotations

import logging
import os
import sys

from s2t2_dist.config import save_config
from s2t2_dist.data.config import DataConfig
from s2t2_dist.distributed.env import detect
from s2t2_dist.stages.common import parse_args

log = logging.getLogger("s2t2.prepare")


def run(cfg: DataConfig, *, progress: bool = True) -> dict:
    from s2t2_dist.data.pipeline import format_summary, prepare
    from s2t2_dist.stages import checks

    checks.run_dir(cfg.output_dir, "output_dir", stage="prepare")
    checks.distinct_inputs(list(cfg.inputs), format=cfg.format)
    checks.claim_run_dir(cfg.output_dir, "prepare", True, key="output_dir")  # rank 0 only runs prepare
    summary = prepare(cfg, progress=progress)
    save_config(cfg, os.path.join(cfg.output_dir, "prepare_config.yaml"))  # the config these outputs came from
    print(format_summary(summary), flush=True)
    return summary


def parse_config(argv: list[str]) -> DataConfig:
    """The config from the command line (`s2t2 submit` checks it with this before queueing)."""
    return parse_args(DataConfig, argv, "s2t2 prepare")[0]


def main(argv: list[str] | None = None) -> int:
    from s2t2_dist.stages.common import run_main

    argv = list(sys.argv[1:] if argv is None else argv)

    def work() -> int:
        from s2t2_dist import envvars

        envvars.setup_logging()  # inside run_main: a bad S2T2_LOG_LEVEL is one line
        cfg, args = parse_args(DataConfig, argv, "s2t2 prepare")  # --no-progress: every stage takes it
        env = detect()
        if not env.is_main:
            log.info("rank %d: data preparation runs on rank 0 only; nothing to do here", env.rank)
            return 0
        run(cfg, progress=not args.no_progress)
        return 0

    return run_main("s2t2 prepare", work)
