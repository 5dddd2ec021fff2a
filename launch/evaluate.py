#!/usr/bin/env python
"""Evaluation entry point (perplexity, bits-per-byte, random-guess line):

    python launch/evaluate.py --config configs/evaluate_olmo1b.yaml model.path=runs/finetune_olmo1b/final
    torchrun --nproc_per_node 8 launch/evaluate.py --config configs/evaluate_olmo1b.yaml
    deepspeed --num_gpus 8 launch/evaluate.py --ds_config configs/ds_zero3.json --config configs/evaluate_transfer_7b.yaml
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from s2t2_dist.cli import main  # SIGTERM/SIGUSR1 handled before the stage's heavy imports (utils/stop.py)
from s2t2_dist.distributed.exit import exit_process
if __name__ == "__main__":
    exit_process(main(["evaluate", *sys.argv[1:]]))
