#!/bin/bash
# Evaluation (perplexity and bits-per-byte on the held-out split); documents are split over the tasks.
#
#   sbatch slurm/evaluate.sh                                       # configs/evaluate_olmo1b.yaml
#   sbatch --gpus-per-node=4 --ntasks-per-node=4 slurm/evaluate.sh --config configs/evaluate_olmo1b.yaml model.path=runs/f7b/final
#
# Header values are defaults: sbatch command-line options (and SBATCH_* variables) override them. Keep
# --ntasks-per-node equal to --gpus-per-node. Arguments are passed to the entry point. Submit from the
# repository root, or set S2T2_HOME. See docs/slurm.md.
#SBATCH --job-name=s2t2-evaluate
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue

S2T2_HOME=${S2T2_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
if [ ! -f "$S2T2_HOME/slurm/common.sh" ]; then
    echo "cannot find slurm/common.sh under S2T2_HOME=$S2T2_HOME: submit from the repository root or set S2T2_HOME" >&2
    exit 2
fi
# shellcheck source=common.sh
. "$S2T2_HOME/slurm/common.sh"

: "${S2T2_CONFIG:=configs/evaluate_olmo1b.yaml}"
s2t2_run_stage evaluate "$@"
