#!/usr/bin/env python
"""Data preparation entry point: `python launch/prepare.py --config configs/prepare_uniref50.yaml [key=value ...]`."""
import sys

from s2t2_dist.stages.prepare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
