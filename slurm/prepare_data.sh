#!/bin/bash
# Data preparation (split, train the target BPE tokenizer, write webdataset shards): one CPU task, no GPU.
#
#   sbatch slurm/prepare_data.sh                                   # configs/prepare_uniref50.yaml
#   sbatch --cpus-per-task=32 slurm/prepare_data.sh --config configs/prepare_text.yaml
#
# Header values are defaults: sbatch command-line options (and SBATCH_* variables) override them. Arguments are
# passed to the entry point. Submit from the repository root, or set S2T2_HOME. See docs/slurm.md.
#SBATCH --job-name=s2t2-prepare
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
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

: "${S2T2_CONFIG:=configs/prepare_uniref50.yaml}"
s2t2_run_stage prepare "$@"
