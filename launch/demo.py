#!/usr/bin/env python
"""The whole pipeline on the shipped protein sample, in minutes on a CPU: `python launch/demo.py [--out DIR] [--ranks N]`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from s2t2_dist.recipes.demo import main
from s2t2_dist.distributed.exit import exit_process
if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
