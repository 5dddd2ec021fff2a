#!/usr/bin/env python
"""Stage 1 entry point: `torchrun --nproc_per_node N launch/translate.py --config configs/translate_olmo1b.yaml`."""
import sys

from s2t2_dist.stages.translate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
