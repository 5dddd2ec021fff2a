#!/usr/bin/env python
"""Data preparation entry point: `python launch/prepare.py --config configs/prepare_uniref50.yaml [key=value ...]`."""
import sys

from s2t2_dist.cli import main  # SIGTERM/SIGUSR1 handled before the stage's heavy imports (utils/stop.py)
from s2t2_dist.distributed.exit import exit_process

if __name__ == "__main__":
    exit_process(main(["prepare", *sys.argv[1:]]))
