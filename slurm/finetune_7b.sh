#!/bin/bash
# Stage 2 (finetune: the whole translated OLMo-7B under DeepSpeed ZeRO), one task per GPU.
#
#   sbatch slurm/finetune_7b.sh                                   # configs/finetune_olmo7b.yaml
#   sbatch --nodes=2 --time=4:00:00 slurm/finetune_7b.sh train.steps=4000 run_dir=runs/f7b
#   S2T2_CONFIG=my.yaml sbatch --partition=gpu --account=proj slurm/finetune_7b.sh
#
# Header values are defaults: sbatch command-line options (and SBATCH_* variables) override them. Keep
# --ntasks-per-node equal to --gpus-per-node. Arguments are passed to the entry point (dotted overrides, or
# --config FILE). Submit from the repository root, or set S2T2_HOME. See slurm/common.sh and docs/slurm.md.
# S2T2_LAUNCHER=deepspeed starts one `deepspeed` launcher per node instead of one srun task per GPU.
#SBATCH --job-name=s2t2-finetune-7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@480
#SBATCH --requeue

S2T2_HOME=${S2T2_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
if [ ! -f "$S2T2_HOME/slurm/common.sh" ]; then
    echo "cannot find slurm/common.sh under S2T2_HOME=$S2T2_HOME: submit from the repository root or set S2T2_HOME" >&2
    exit 2
fi
# shellcheck source=common.sh
. "$S2T2_HOME/slurm/common.sh"

: "${S2T2_CONFIG:=configs/finetune_olmo7b.yaml}"
s2t2_run_stage finetune "$@"
