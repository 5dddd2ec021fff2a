#!/usr/bin/env python
"""Stage 2 entry point (whole-model finetuning):

    deepspeed --num_gpus 8 launch/finetune.py --ds_config configs/ds_zero3.json --config configs/finetune_olmo7b.yaml
    torchrun --nproc_per_node 8 launch/finetune.py --config configs/finetune_olmo1b.yaml engine.kind=fsdp
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from s2t2_dist.cli import main  # SIGTERM/SIGUSR1 handled before the stage's heavy imports (utils/stop.py)
from s2t2_dist.distributed.exit import exit_process
if __name__ == "__main__":
    exit_process(main(["finetune", *sys.argv[1:]]))
