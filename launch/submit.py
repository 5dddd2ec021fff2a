#!/usr/bin/env python
"""Submit a stage to SLURM with submitit: `python launch/submit.py translate --config CONFIG --nodes 2 --wait`
(the same as `s2t2 submit ...`; see s2t2_dist/launch/submit.py)."""
import sys

from s2t2_dist.launch.submit import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
