#!/usr/bin/env python
"""Stage 1 entry point: `torchrun --nproc_per_node N launch/translate.py --config configs/translate_olmo1b.yaml`."""
import sys

from s2t2_dist.cli import main  # SIGTERM/SIGUSR1 handled before the stage's heavy imports (utils/stop.py)
from s2t2_dist.distributed.exit import exit_process

if __name__ == "__main__":
    exit_process(main(["translate", *sys.argv[1:]]))
