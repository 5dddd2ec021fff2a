# shellcheck shell=bash
# Shared by slurm/*.sh (sourced, not run): rendezvous from SLURM's environment and one job step that checkpoints
# and requeues on the time-limit warning.
#
# Contract with the Python entry points (launch/*.py, python -m s2t2_dist.cli ...):
#   - every task finds its rank from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODEID and the rendezvous
#     from MASTER_ADDR/MASTER_PORT exported here (s2t2_dist.distributed.env.init_distributed());
#   - on SIGUSR1 or SIGTERM a training entry writes a checkpoint at the next step boundary and exits with code 0;
#     started again it resumes from the latest checkpoint in its run directory.
# Requeue: the scripts ask for `--signal=B:USR1@LEAD`, so LEAD s before the time limit SLURM signals this batch
# shell (only); LEAD is the time the final checkpoint needs (s2t2_dist/cluster/layout.py: its size at 0.5 GB/s per
# node, x 1.5, + 120 s; the pre-flight logs it for the actual config). s2t2_srun forwards SIGUSR1 to every process of the job step, waits for the step to stop and,
# if it stopped cleanly, runs `scontrol requeue $SLURM_JOB_ID`: the job goes back to the queue (same job id,
# SLURM_RESTART_COUNT + 1) and resumes from the checkpoint. On preemption (PreemptMode=REQUEUE) and on
# `scontrol requeue`, SLURM sends SIGTERM to the step itself and requeues the job itself; on scancel it does not.
#
# Variables (all optional):
#   S2T2_HOME         repository root holding slurm/ and launch/ (default: the folder sbatch was run from)
#   S2T2_PYTHON       python interpreter (default: python, else python3)
#   S2T2_ENTRY        what python runs, e.g. "launch/translate.py" or "-m s2t2_dist.cluster.probe"
#   S2T2_CONFIG       the stage's YAML config
#   S2T2_MASTER_ADDR  rendezvous address (default: NodeAddr of the first node of the allocation)
#   S2T2_MASTER_PORT  rendezvous port (default: 20000 + job id % 12000, below Linux's ephemeral ports)
#   S2T2_SRUN_ARGS    extra srun options, e.g. "--cpu-bind=cores"
#   S2T2_REQUEUE      no/false/off/0: never requeue (default yes)
#   S2T2_MAX_RESTARTS stop requeueing after this many restarts (a whole number >= 0, default 50)
#   S2T2_DEVICE=cpu   run on CPU with gloo even if GPUs are present (tests)
# Every S2T2_* variable is declared, typed and checked in one place, s2t2_dist/envvars.py (docs/environment.md):
# s2t2_run_stage checks them all before anything starts (one line naming a bad one, exit 2) and the typed ones are
# read here through `s2t2_env NAME`, so the shell and Python agree on what "no" or "10.5" means.

s2t2_log() { echo "[s2t2 $(date +%H:%M:%S) job ${SLURM_JOB_ID:-?}] $*" >&2; }

s2t2_require_slurm() {
    if [ -z "${SLURM_JOB_ID:-}" ]; then
        echo "this script runs inside a SLURM allocation: submit it with sbatch (see docs/slurm.md)" >&2
        exit 2
    fi
}

# Python interpreter and entry point of a stage: launch/<stage>.py from the repository when present, else the
# installed package's CLI.
s2t2_python() {
    if [ -n "${S2T2_PYTHON:-}" ]; then echo "$S2T2_PYTHON"
    elif command -v python >/dev/null 2>&1; then echo python
    else echo python3; fi
}

# s2t2_env NAME: the value of a declared S2T2_* variable as s2t2_dist/envvars.py reads it (booleans 1/0, its
# default when unset); a bad value prints one line naming it and the call fails.
s2t2_env() {
    PYTHONPATH="$S2T2_HOME${PYTHONPATH:+:$PYTHONPATH}" "$(s2t2_python)" -m s2t2_dist.envvars get "$1"
}

# Every S2T2_* variable (the package's and these scripts'), before any rank starts: one line, exit 2.
s2t2_check_env() {
    PYTHONPATH="$S2T2_HOME${PYTHONPATH:+:$PYTHONPATH}" "$(s2t2_python)" -m s2t2_dist.envvars check || exit 2
}

s2t2_entry() {  # s2t2_entry STAGE -> words after the interpreter
    local stage=$1
    if [ -n "${S2T2_ENTRY:-}" ]; then echo "$S2T2_ENTRY"
    elif [ -f "$S2T2_HOME/launch/$stage.py" ]; then echo "$S2T2_HOME/launch/$stage.py"
    else echo "-m s2t2_dist.cli $stage"; fi
}

# MASTER_ADDR: the first node of the allocation, by the address SLURM knows it at (node names need not resolve);
# MASTER_PORT: derived from the job id, so every task computes the same one without talking to the others.
# Computed in one place, s2t2_dist/distributed/rendezvous.py (no torch import: fast).
s2t2_rendezvous() {
    local exports
    exports=$(PYTHONPATH="$S2T2_HOME${PYTHONPATH:+:$PYTHONPATH}" "$(s2t2_python)" -m s2t2_dist.distributed.rendezvous) \
        || { s2t2_log "could not compute the rendezvous (python -m s2t2_dist.distributed.rendezvous)"; exit 1; }
    eval "$exports"
    # srun must not pass on a torchrun-style rank from the submitting shell: each task takes its own from SLURM.
    unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK
    if [ -z "${OMP_NUM_THREADS:-}" ]; then export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}; fi
    s2t2_log "nodes=${SLURM_JOB_NODELIST} ntasks=${SLURM_NTASKS:-?} tasks/node=${SLURM_NTASKS_PER_NODE:-?}" \
             "gpus/node=${SLURM_GPUS_PER_NODE:-0} master=${MASTER_ADDR}:${MASTER_PORT}" \
             "restart=${SLURM_RESTART_COUNT:-0}"
}

_S2T2_STOP=0
_S2T2_STEP_PID=

_s2t2_on_usr1() {
    s2t2_log "SIGUSR1 (time limit close or preemption notice): asking the job step to checkpoint and stop"
    _S2T2_STOP=1
    # srun passes SIGUSR1 on to every process of the step (all tasks and their children).
    if [ -n "$_S2T2_STEP_PID" ]; then kill -USR1 "$_S2T2_STEP_PID" 2>/dev/null || true; fi
}

_s2t2_on_term() {
    # scancel, preemption and `scontrol requeue` signal the step's processes directly; just wait for them.
    s2t2_log "SIGTERM: job cancelled, preempted or requeued; the step checkpoints and stops on its own"
}

# s2t2_srun [srun options ...] -- command ...
# Runs the command as one job step (one task per GPU, from the allocation), forwards the time-limit warning and
# requeues the job when the step stopped for it. Returns the step's exit code.
s2t2_srun() {
    local srun_opts=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do srun_opts+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then srun_opts+=("--cpus-per-task=$SLURM_CPUS_PER_TASK"); fi
    # shellcheck disable=SC2206
    local extra=(${S2T2_SRUN_ARGS:-})
    # Rank 0 of a run that finished writes "finished" here (s2t2_dist/utils/stop.py): a warning that came during
    # the final export or after the result must not requeue it. Rank 0 runs on the first node, as this shell does.
    local report
    report=$(mktemp -d "${TMPDIR:-/tmp}/s2t2-step-${SLURM_JOB_ID:-0}.XXXXXX") || return 1
    export S2T2_STEP_REPORT_DIR=$report
    trap _s2t2_on_usr1 USR1
    trap _s2t2_on_term TERM
    s2t2_log "srun ${srun_opts[*]} ${extra[*]} ${_S2T2_STEP_DESC:-$*}"
    srun --kill-on-bad-exit=1 "${srun_opts[@]}" "${extra[@]}" "$@" &
    _S2T2_STEP_PID=$!
    local rc
    while :; do
        wait "$_S2T2_STEP_PID"
        rc=$?
        # wait returns >128 when a trapped signal interrupts it while the step still runs
        if [ "$rc" -gt 128 ] && kill -0 "$_S2T2_STEP_PID" 2>/dev/null; then continue; fi
        break
    done
    _S2T2_STEP_PID=
    s2t2_log "job step exited with code $rc"
    if [ "$_S2T2_STOP" = 1 ] && [ "$rc" = 0 ]; then
        if [ -e "$report/finished" ]; then
            s2t2_log "the run finished (the warning came during its final export or after it); not requeued"
        else
            s2t2_requeue
        fi
    fi
    rm -rf "$report"
    unset S2T2_STEP_REPORT_DIR
    trap - USR1 TERM
    return "$rc"
}

s2t2_requeue() {
    local restarts=${SLURM_RESTART_COUNT:-0} requeue max
    requeue=$(s2t2_env S2T2_REQUEUE) && max=$(s2t2_env S2T2_MAX_RESTARTS) || {
        s2t2_log "stopped with a checkpoint; not requeued: a bad S2T2_REQUEUE or S2T2_MAX_RESTARTS (above)"
        return 0
    }
    if [ "$requeue" = 0 ]; then
        s2t2_log "stopped with a checkpoint; not requeued (S2T2_REQUEUE is off): resubmit to continue"
        return 0
    fi
    if [ "$restarts" -ge "$max" ]; then
        s2t2_log "stopped with a checkpoint; not requeued: already restarted $restarts times (S2T2_MAX_RESTARTS)"
        return 0
    fi
    s2t2_log "stopped with a checkpoint; requeueing (restart $((restarts + 1))); it resumes from the checkpoint"
    # Requeueing our own job ends this shell; the job returns to the queue with the same id.
    scontrol requeue "$SLURM_JOB_ID"
}

# s2t2_run_stage STAGE [args ...]: the whole body of a stage script.
s2t2_run_stage() {
    local stage=$1; shift
    s2t2_require_slurm
    s2t2_check_env
    s2t2_rendezvous
    local py entry
    py=$(s2t2_python)
    entry=$(s2t2_entry "$stage")
    local cfg=()
    if [ -n "${S2T2_CONFIG:-}" ]; then cfg=(--config "$S2T2_CONFIG"); fi
    # the repository's package wins over an older installed copy; relative paths stay relative to the submit dir
    export PYTHONPATH="$S2T2_HOME${PYTHONPATH:+:$PYTHONPATH}"
    # Pre-flight in the batch shell, before any rank starts: the config parses and its batch layout fits the
    # allocation (one line naming the keys, exit 2); logs the signal lead time the checkpoint needs. Skipped for a
    # custom S2T2_ENTRY (its arguments are not a stage's).
    if [ -z "${S2T2_ENTRY:-}" ]; then
        "$py" -m s2t2_dist.cluster.layout "$stage" "${cfg[@]}" "$@" || exit 2
    fi
    if [ "$(s2t2_env S2T2_LAUNCHER)" = deepspeed ]; then
        # shellcheck disable=SC2086
        s2t2_srun_deepspeed "$py" $entry "${cfg[@]}" "$@"
    else
        # one task per GPU (the allocation's --ntasks-per-node); ranks come from SLURM
        # shellcheck disable=SC2086
        s2t2_srun -- "$py" -u $entry "${cfg[@]}" "$@"
    fi
}

# One `deepspeed` launcher per node (S2T2_LAUNCHER=deepspeed), each starting the node's GPU ranks with
# RANK/LOCAL_RANK/WORLD_SIZE set; for setups that rely on the launcher (its --bind_cores_to_rank, per-rank logs).
# The launchers ignore SIGUSR1 (so the time-limit warning reaches the ranks, which checkpoint and exit 0, instead
# of killing the launcher); SIGTERM makes them pass SIGTERM on and wait up to 30 s.
s2t2_srun_deepspeed() {
    local py=$1; shift
    local script=$1; shift
    local tpn=${SLURM_NTASKS_PER_NODE:-1}
    tpn=${tpn%%\(*}             # "2(x2)" -> 2
    local per_node
    per_node=$(s2t2_env S2T2_GPUS_PER_NODE) || exit 2
    [ "$per_node" = 0 ] && per_node=${SLURM_GPUS_PER_NODE:-$tpn}  # 0: unset
    per_node=${per_node##*:}   # "a100:4" -> 4
    local nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    local cpus=$(( ${SLURM_CPUS_PER_TASK:-1} * tpn ))
    local mode=()
    if [ "$script" = "-m" ]; then mode=(--module); script=$1; shift; fi
    # Each node's task writes the hostfile (node-local TMPDIR) from the allocation's node list, starts the
    # launcher with SIGUSR1 ignored, waits for it through SIGTERM (which reaches the launcher directly) and removes
    # the hostfile.
    # shellcheck disable=SC2016
    local body='hf=${TMPDIR:-/tmp}/s2t2-hostfile-$SLURM_JOB_ID-$SLURM_NODEID
        scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$_S2T2_DS_PER_NODE/" > "$hf"
        trap "" USR1
        trap : TERM
        "$_S2T2_DS_PYTHON" -m deepspeed.launcher.runner --hostfile "$hf" --no_ssh --node_rank "$SLURM_NODEID" \
            --num_nodes "$_S2T2_DS_NNODES" --num_gpus "$_S2T2_DS_PER_NODE" \
            --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@" &
        pid=$!
        while :; do
            wait "$pid"; rc=$?
            if [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; then continue; fi
            break
        done
        rm -f "$hf"
        exit "$rc"'
    export _S2T2_DS_PER_NODE=$per_node _S2T2_DS_NNODES=$nnodes _S2T2_DS_PYTHON=$py
    _S2T2_STEP_DESC="deepspeed --no_ssh --num_nodes $nnodes --num_gpus $per_node ${mode[*]} $script $*" \
    SLURM_CPUS_PER_TASK=$cpus s2t2_srun --ntasks-per-node=1 --ntasks="$nnodes" -- \
        bash -c "$body" s2t2-deepspeed "${mode[@]}" "$script" "$@"
}
