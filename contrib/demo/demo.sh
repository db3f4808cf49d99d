#!/usr/bin/env bash
# The slurm-recovery demo (`make demo`): a two-node training job on a real Slurm,
# interrupted by a requeue, resumed from its checkpoint, finished.
#
# Needs the package installed (recovery-devcluster on PATH) and Slurm + munge.
# Environment:
#   DEMO_STATE_DIR   dev cluster state dir  [default: recovery-devcluster's own:
#                    $RECOVERY_DEVCLUSTER_DIR or /tmp/recovery-devcluster-UID]
#   DEMO_PORT        slurmctld port         [default: recovery-devcluster's, 16817]
#   DEMO_NODES       nodes to start         [default: 4]
#   DEMO_TRAIN_ARGS  flags for train.py     [default: --steps 300 --step-time 0.1 --ckpt-every 25]
#   DEMO_PYTHON      interpreter for the job [default: python3 on PATH]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
train_py="$repo/examples/train.py"
train_sbatch="$repo/examples/train.sbatch"
nodes="${DEMO_NODES:-4}"
read -r -a train_args <<< "${DEMO_TRAIN_ARGS:---steps 300 --step-time 0.1 --ckpt-every 25}"

cluster_args=()
[[ -n "${DEMO_STATE_DIR:-}" ]] && cluster_args+=(--state-dir "$DEMO_STATE_DIR")
up_args=(--nodes "$nodes" "${cluster_args[@]}")
[[ -n "${DEMO_PORT:-}" ]] && up_args+=(--port "$DEMO_PORT")

t0=$SECONDS
step_no=0
job=""
out=""

step() { step_no=$((step_no + 1)); printf '\n== %d. %s  [t+%ds]\n' "$step_no" "$*" "$((SECONDS - t0))"; }
say() { printf '   %s\n' "$*"; }
die() {
    printf '\ndemo: error: %s\n' "$*" >&2
    if [[ -n "$job" ]]; then
        printf 'demo: look at: scontrol show job %s\n' "$job" >&2
        [[ -n "$out" ]] && printf 'demo:          %s\n' "$out" >&2
    fi
    exit 1
}
need() { command -v "$1" >/dev/null || die "$1 not found on PATH ($2)"; }

# The fields of `scontrol show job` this demo talks about, on one line.
job_fields() {
    scontrol show job -o "$job" 2>/dev/null | tr ' ' '\n' \
        | grep -E '^(JobState|Reason|Restarts|NodeList|BatchHost|StartTime|ExitCode)=' \
        | tr '\n' ' ' || true
}
# The job's state as squeue says it (COMPLETING shows here, not in scontrol),
# or scontrol's once the job has left the queue.
job_state() {
    local s
    s="$(squeue -h -j "$job" -o %T 2>/dev/null || true)"
    [[ -n "$s" ]] || s="$(scontrol show job -o "$job" 2>/dev/null \
                           | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)"
    echo "${s:-UNKNOWN}"
}
# wait_for SECONDS WHAT CMD...: poll CMD every second until it succeeds.
wait_for() {
    local limit="$1" what="$2"; shift 2
    local deadline=$((SECONDS + limit))
    until "$@"; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what (job state: $(job_state))"
        sleep 1
    done
}
is_state() { [[ "$(job_state)" == "$1" ]]; }
is_not_state() { [[ "$(job_state)" != "$1" ]]; }
is_finished() { case "$(job_state)" in PENDING|RUNNING|CONFIGURING|COMPLETING|REQUEUED*|SUSPENDED) return 1;; esac; }
output_has() { [[ -f "$out" ]] && (( $(grep -c -- "$1" "$out" || true) >= $2 )); }

# Print the job output's new complete lines, indented; $shown counts those printed.
shown=0
show_new_output() {
    [[ -f "$out" ]] || return 0
    local total
    total="$(wc -l < "$out")"
    if ((total > shown)); then
        sed -n "$((shown + 1)),${total}p" "$out" | sed 's/^/   | /'
        shown=$total
    fi
}
# follow SECONDS: show output as it arrives, until SECONDS pass or the job stops running.
follow() {
    local deadline=$((SECONDS + $1))
    while ((SECONDS < deadline)) && is_state RUNNING; do
        show_new_output
        sleep 1
    done
    show_new_output
}

need recovery-devcluster "install the package: pip install -e ."
need python3 "the training job runs on it"

cat <<EOF
slurm-recovery demo: a training job survives an interruption on a real Slurm.

  1. start a ${nodes}-node dev cluster (munge, slurmctld, one slurmd per node, all local)
  2. submit examples/train.sbatch: 2 nodes, one rank each, a checkpoint every few steps
  3. wait for it to run
  4. watch it train
  5. interrupt it with \`scontrol requeue\` (what slurm-recovery does after a fault)
  6. skip Slurm's requeue delay (StartTime=now); watch it resume from its checkpoint
  7. let it finish
  8. summary
EOF

step "Start the dev cluster"
recovery-devcluster up "${up_args[@]}" || die "recovery-devcluster up failed (see the message above)"
eval "$(recovery-devcluster env "${cluster_args[@]}")"
need sbatch "install Slurm's client commands"
recovery-devcluster status "${cluster_args[@]}" || die "the dev cluster is not healthy"
state_dir="$(recovery-devcluster status --json "${cluster_args[@]}" \
             | python3 -c 'import json, sys; print(json.load(sys.stdin)["state_dir"])')"
jobs_dir="$state_dir/jobs"
[[ -d "$jobs_dir" ]] || die "no jobs dir at $jobs_dir"

step "Submit the training job"
ckpt_dir="$jobs_dir/demo-ckpt-$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$ckpt_dir"
cd "$jobs_dir"
job="$(TRAIN_PY="$train_py" CKPT_DIR="$ckpt_dir" PYTHON="${DEMO_PYTHON:-$(command -v python3)}" \
       sbatch --parsable "$train_sbatch" "${train_args[@]}")" || die "sbatch failed"
job="${job%%;*}"
out="$jobs_dir/demo-train-$job.out"
say "sbatch --parsable examples/train.sbatch ${train_args[*]}  ->  job $job"
say "output:      $out"
say "checkpoints: $ckpt_dir"

step "Wait for it to run (60 s at most)"
wait_for 60 "job $job to start RUNNING" is_state RUNNING
squeue -j "$job" -o '%.8i %.12j %.10T %.10M %.6D %R' | sed 's/^/   /'
say "$(job_fields)"

step "Watch it train (15 s)"
follow 15
is_state RUNNING || die "the job stopped before the requeue (state $(job_state)); give it more --steps"
wait_for 30 "a first checkpoint" output_has 'checkpoint saved:' 1
last_ckpt="$(grep 'checkpoint saved:' "$out" | tail -n 1 | sed 's/.*checkpoint saved: //; s/ step=.*//')"
say "newest checkpoint before the interruption: $last_ckpt"

step "Interrupt it: scontrol requeue $job"
say "Slurm sends SIGTERM to every rank, then puts the job back in the queue."
scontrol requeue "$job" || die "scontrol requeue $job failed"
wait_for 60 "job $job to leave COMPLETING after the requeue" is_state PENDING
show_new_output
say "$(job_fields)"
say "Slurm 22.05 holds a requeued job back ~2 min (Reason=BeginTime); skip that:"
say "scontrol update jobid=$job StartTime=now"
scontrol update jobid="$job" StartTime=now || die "scontrol update jobid=$job StartTime=now failed"

step "Watch it resume (60 s at most)"
wait_for 60 "job $job to run again" is_not_state PENDING
say "$(job_fields)"
ranks="$(grep -c 'starting fresh' "$out" || true)"
wait_for 30 "every rank to print 'resuming from checkpoint'" output_has 'resuming from checkpoint' "$ranks"
grep 'resuming from checkpoint' "$out" | sed 's/^/   > /'
restarts="$(job_fields | grep -o 'Restarts=[0-9]*' | cut -d= -f2)"
say "Restarts=$restarts: same job id, attempt $((restarts + 1)), same checkpoint dir."
follow 5

step "Let it finish (120 s at most)"
wait_for 120 "job $job to finish" is_finished
show_new_output
final="$(job_state)"
say "$(job_fields)"
[[ "$final" == COMPLETED ]] || die "job $job ended $final, not COMPLETED"

step "Summary"
say "job $job: $final after $((restarts + 1)) attempts (Restarts=$restarts)"
say "$(grep -c 'checkpoint saved:' "$out") checkpoints saved; newest: $(ls "$ckpt_dir" | tail -n 1)"
say "$(grep 'rank 0/.*training finished' "$out" | tail -n 1 | sed 's/^\[[^]]*\] //')"
say "the requeue cost only the steps since $(basename "$last_ckpt"), not the whole run."
say "demo took $((SECONDS - t0)) s"
devcluster="$(command -v recovery-devcluster)"
cat <<EOF

The cluster is still running. Try it yourself:
   eval "\$($devcluster env${cluster_args[*]:+ ${cluster_args[*]}})"
   sinfo; squeue; cat $out
Stop it with:
   make down      (or: $devcluster down${cluster_args[*]:+ ${cluster_args[*]}})
EOF
