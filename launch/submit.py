#!/usr/bin/env python
"""Submit a stage to SLURM with submitit: `python launch/submit.py translate --config CONFIG --nodes 2 --wait`
(the same as `s2t2 submit ...`; see s2t2_dist/cluster/submit.py)."""
import sys

from s2t2_dist.cluster.submit import main
from s2t2_dist.distributed.exit import exit_process

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
