#!/usr/bin/env python
"""The whole pipeline on the shipped protein sample, in minutes on a CPU: `python launch/demo.py [--out DIR] [--ranks N]`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from s2t2_dist.stages.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
