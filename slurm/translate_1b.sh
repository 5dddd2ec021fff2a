#!/bin/bash
# Stage 1 (translate: learn P through a frozen OLMo-1B), one task per GPU, C sharded over all ranks.
#
#   sbatch slurm/translate_1b.sh                                   # configs/translate_olmo1b.yaml
#   sbatch --nodes=2 --time=4:00:00 slurm/translate_1b.sh train.steps=4000 run_dir=runs/t1b
#   S2T2_CONFIG=my.yaml sbatch --partition=gpu --account=proj slurm/translate_1b.sh
#
# Header values are defaults: sbatch command-line options (and SBATCH_* variables) override them. Keep
# --ntasks-per-node equal to --gpus-per-node. Arguments are passed to the entry point (dotted overrides, or
# --config FILE). Submit from the repository root, or set S2T2_HOME. See slurm/common.sh and docs/slurm.md.
#SBATCH --job-name=s2t2-translate-1b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=08:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@180
#SBATCH --requeue

S2T2_HOME=${S2T2_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
if [ ! -f "$S2T2_HOME/slurm/common.sh" ]; then
    echo "cannot find slurm/common.sh under S2T2_HOME=$S2T2_HOME: submit from the repository root or set S2T2_HOME" >&2
    exit 2
fi
# shellcheck source=common.sh
. "$S2T2_HOME/slurm/common.sh"

: "${S2T2_CONFIG:=configs/translate_olmo1b.yaml}"
s2t2_run_stage translate "$@"
