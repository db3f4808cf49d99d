#!/usr/bin/env bash
# The slurm-recovery demo (`make demo`): a two-node training job on a real Slurm
# loses a GPU (XID 79); the agent detects it, drains the node, requeues the job
# without it, and the job resumes from its checkpoint and finishes. Then the
# same fault in monitor mode: the decision is recorded, Slurm is left alone.
#
# Needs the package installed (recovery-devcluster, recovery-agent and
# recovery-ctl on PATH) and Slurm + munge. Environment:
#   DEMO_STATE_DIR   dev cluster state dir  [default: recovery-devcluster's own:
#                    $RECOVERY_DEVCLUSTER_DIR or /tmp/recovery-devcluster-UID]
#   DEMO_PORT        slurmctld port         [default: recovery-devcluster's, 16817]
#   DEMO_NODES       nodes to start         [default: 4]
#   DEMO_TRAIN_ARGS  flags for train.py     [default: --steps 300 --step-time 0.1 --ckpt-every 25]
#   DEMO_PYTHON      interpreter for the job [default: python3 on PATH]
#   DEMO_SKIP_MONITOR=1  skip the second (monitor-mode) run
#
# The last line is machine-readable:
#   RECOVERED job=<id> attempts=<n> excluded=<nodes> detect_s=<x> action_s=<y> running_again_s=<z>
# and the exit status is non-zero when the recovery did not happen.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
train_py="$repo/examples/train.py"
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
agent_pid=""

step() { step_no=$((step_no + 1)); printf '\n== %d. %s  [t+%ds]\n' "$step_no" "$*" "$((SECONDS - t0))"; }
say() { printf '   %s\n' "$*"; }
die() {
    printf '\ndemo: error: %s\n' "$*" >&2
    if [[ -n "$job" ]]; then
        printf 'demo: look at: scontrol show job %s\n' "$job" >&2
        [[ -n "$out" ]] && printf 'demo:          %s\n' "$out" >&2
    fi
    [[ -n "${agent_log:-}" ]] && printf 'demo: agent log: %s\n' "$agent_log" >&2
    exit 1
}
need() { command -v "$1" >/dev/null || die "$1 not found on PATH ($2)"; }
stop_agent() {
    if [[ -n "$agent_pid" ]] && kill -0 "$agent_pid" 2>/dev/null; then
        kill "$agent_pid" 2>/dev/null || true
        wait "$agent_pid" 2>/dev/null || true
    fi
}
trap stop_agent EXIT

job_state() {
    local s
    s="$(squeue -h -j "$job" -o %T 2>/dev/null || true)"
    [[ -n "$s" ]] || s="$(scontrol show job -o "$job" 2>/dev/null \
                           | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)"
    echo "${s:-UNKNOWN}"
}
job_field() { scontrol show job -o "$job" 2>/dev/null | tr ' ' '\n' | grep "^$1=" | cut -d= -f2- || true; }
wait_for() {
    local limit="$1" what="$2"; shift 2
    local deadline=$((SECONDS + limit))
    until "$@"; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what (job state: $(job_state))"
        sleep 0.5
    done
}
is_state() { [[ "$(job_state)" == "$1" ]]; }
is_finished() { case "$(job_state)" in PENDING|RUNNING|CONFIGURING|COMPLETING|REQUEUED*|SUSPENDED) return 1;; esac; }
output_has() { [[ -f "$out" ]] && (( $(grep -c -- "$1" "$out" || true) >= $2 )); }
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
follow() {
    local deadline=$((SECONDS + $1))
    while ((SECONDS < deadline)) && is_state RUNNING; do show_new_output; sleep 1; done
    show_new_output
}
# rec FIELD [STATUS...]: a field of the job's first job-level recommendation (from the store)
rec() {
    recovery-ctl audit --json --job "$job" --db "$db" 2>/dev/null | python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    rec = json.loads(line)
    if rec["scope"] == "job":
        value = rec.get(want)
        print(",".join(value) if isinstance(value, list) else ("" if value is None else value))
        break' "$1"
}
rec_is() { [[ "$(rec status)" == "$1" ]]; }
rec_final() { case "$(rec status)" in ""|proposed|executing) return 1;; esac; }

submit() {   # submit MODE: the training job with --recovery=demo:MODE
    local mode="$1"
    local ckpt="$jobs_dir/demo-ckpt-$(date +%Y%m%d-%H%M%S)-$mode-$$"
    mkdir -p "$ckpt"
    shown=0
    job="$(cd "$jobs_dir" && sbatch --parsable --job-name="demo-$mode" -N2 --ntasks-per-node=1 \
           --open-mode=append --requeue -o '%x-%j.out' "$recovery_flag=demo:$mode" \
           --wrap "srun --kill-on-bad-exit=1 ${DEMO_PYTHON:-$(command -v python3)} $train_py \
                   --ckpt-dir $ckpt --xid-log $state_dir/nodes/{node}/kern.log ${train_args[*]}")" \
        || die "sbatch failed"
    job="${job%%;*}"
    out="$jobs_dir/demo-$mode-$job.out"
    say "sbatch -N2 $recovery_flag=demo:$mode ... train.py ${train_args[*]}  ->  job $job"
    say "output: $out"
}

inject_fault() {   # the job's second node ($fault_node) loses GPU 0
    fault_node="$(scontrol show hostnames "$(job_field NodeList)" | sed -n 2p)"
    [[ -n "$fault_node" ]] || die "job $job has no second node"
    inject_at="$(date +%s.%N)"
    recovery-devcluster inject xid "${cluster_args[@]}" --node "$fault_node" --gpu 0 --xid 79 \
        | sed 's/^/   kern.log: /'
}

need recovery-devcluster "install the package: pip install -e ."
need recovery-agent "install the package: pip install -e ."
need python3 "the training job runs on it"

cat <<EOF
slurm-recovery demo: a GPU fails under a training job on a real Slurm, and the job recovers.

  1. start a ${nodes}-node dev cluster (munge, slurmctld, one slurmd per node, all local)
  2. start the recovery agent (environment "demo" is in action mode)
  3. submit a 2-node training job with --recovery=demo:action; watch it checkpoint
  4. inject XID 79 (GPU fallen off the bus) on one of its nodes; its rank crashes
  5. the agent detects, drains the node, requeues the job without it
  6. the job resumes from its checkpoint elsewhere and finishes
  7. timeline and audit trail
  8. the same fault in monitor mode: recorded as would_have, Slurm untouched
EOF

step "Start the dev cluster"
recovery-devcluster up "${up_args[@]}" || die "recovery-devcluster up failed (see the message above)"
eval "$(recovery-devcluster env "${cluster_args[@]}")"
need sbatch "install Slurm's client commands"
state_dir="$(recovery-devcluster status --json "${cluster_args[@]}" \
             | python3 -c 'import json, sys; print(json.load(sys.stdin)["state_dir"])')"
jobs_dir="$state_dir/jobs"
config="$state_dir/etc/recovery.toml"
recovery_flag="--comment=recovery"
grep -q '^required .*slurm_recovery' "$state_dir/etc/plugstack.conf" 2>/dev/null && recovery_flag="--recovery"
# a clean slate: no faults left from an earlier run, our old drains resumed
for n in $(sinfo -h -N -o %N | sort -u); do
    recovery-devcluster inject clear "${cluster_args[@]}" --node "$n" >/dev/null
    reason="$(sinfo -h -n "$n" -o %E | head -n1)"
    [[ "$reason" == recovery:* ]] && scontrol update nodename="$n" state=resume
done
sinfo -o '%.8P %.6D %.10T %N' | sed 's/^/   /'

step "Start the recovery agent"
export RECOVERY_CONFIG="$config"
mkdir -p "$state_dir/agent"
db="$state_dir/agent/demo-$(date +%Y%m%d-%H%M%S).db"
export RECOVERY_STORE_PATH="$db"
agent_log="$state_dir/log/demo-agent.log"
old_pid="$(cat "$state_dir/agent/demo-agent.pid" 2>/dev/null || true)"
[[ -n "$old_pid" ]] && kill "$old_pid" 2>/dev/null && sleep 1
recovery-agent >"$agent_log" 2>&1 &
agent_pid=$!
echo "$agent_pid" > "$state_dir/agent/demo-agent.pid"
port="$(sed -n 's/^port = //p' "$config" | head -n1)"
for _ in $(seq 60); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/v1/health', timeout=1)" 2>/dev/null && break
    kill -0 "$agent_pid" 2>/dev/null || die "the agent exited: $(tail -n 5 "$agent_log")"
    sleep 0.5
done
say "recovery-agent pid $agent_pid, API on 127.0.0.1:$port, store $db"
say "config $config: [environments.demo] mode = \"action\""

step "Submit the training job (action mode) and watch it train"
submit action
wait_for 60 "job $job to start RUNNING" is_state RUNNING
say "running on $(job_field NodeList)"
wait_for 60 "a first checkpoint" output_has 'checkpoint saved:' 2
show_new_output

step "Inject XID 79 on one of the job's nodes"
inject_fault
bad="$fault_node"
say "node $bad: GPU 0 has fallen off the bus; the rank there hits a CUDA error"

step "The agent detects, drains $bad and requeues the job without it"
wait_for 60 "the agent's recommendation to complete" rec_final
show_new_output
status="$(rec status)"
[[ "$status" == done ]] || die "the recommendation ended $status: $(rec error)"
say "recommendation: $(rec action) exclude=$(rec exclude) rule=$(rec rule) -> $status"
say "node $bad: $(sinfo -h -n "$bad" -o '%T reason=%E' | head -n1)"

step "The job resumes from its checkpoint on healthy nodes"
wait_for 60 "job $job to run again" is_state RUNNING
say "running again on $(job_field NodeList) (Restarts=$(job_field Restarts), ExcNodeList=$(job_field ExcNodeList))"
wait_for 30 "the ranks to resume from a checkpoint" output_has 'resuming from checkpoint' 2
grep 'resuming from checkpoint' "$out" | sed 's/^/   > /'
say "(training on; $(grep -c 'step .*loss' "$out") step lines so far)"
wait_for 120 "job $job to finish" is_finished
shown=$(( $(wc -l < "$out") - 2 ))
show_new_output
final="$(job_state)"
[[ "$final" == COMPLETED ]] || die "job $job ended $final, not COMPLETED"
recovered_job="$job"
attempts=$(( $(job_field Restarts) + 1 ))
excluded="$(rec exclude)"
timing="$(recovery-ctl audit --json --job "$job" --db "$db" | python3 -c '
import json, sys
inject = float(sys.argv[1])
rec = next(r for r in map(json.loads, sys.stdin) if r["scope"] == "job")
detect = rec["detected_at"] - inject
action = rec["done_at"] - rec["detected_at"]
again = (rec["running_again_at"] or float("nan")) - inject
print(f"detect_s={detect:.2f} action_s={action:.2f} running_again_s={again:.2f}")' "$inject_at")"
say "job $job: COMPLETED after $attempts attempts; $timing"

step "Timeline and audit trail"
recovery-ctl show job "$job" --db "$db" | sed 's/^/   /'
echo
recovery-ctl audit --job "$job" --db "$db" | sed 's/^/   /'

if [[ "${DEMO_SKIP_MONITOR:-0}" != 1 ]]; then
    step "The same fault in monitor mode (--recovery=demo:monitor)"
    submit monitor
    wait_for 60 "job $job to start RUNNING" is_state RUNNING
    wait_for 60 "a first checkpoint" output_has 'checkpoint saved:' 1
    inject_fault
    bad2="$fault_node"
    say "XID 79 on $bad2"
    wait_for 60 "the agent's recommendation" rec_final
    wait_for 60 "job $job to end" is_finished
    [[ "$(rec status)" == would_have ]] || die "monitor mode recorded $(rec status), not would_have"
    say "recommendation: $(rec action) exclude=$(rec exclude) -> $(rec status)"
    say "job $job: $(job_state), Restarts=$(job_field Restarts) (not requeued)"
    say "node $bad2: $(sinfo -h -n "$bad2" -o '%T %E' | head -n1) (not drained)"
    [[ "$(job_field Restarts)" == 0 ]] || die "monitor mode requeued job $job"
    sinfo -h -n "$bad2" -o %T | grep -qi drain && die "monitor mode drained $bad2"
    recovery-devcluster inject clear "${cluster_args[@]}" --node "$bad2" >/dev/null
fi

recovery-devcluster inject clear "${cluster_args[@]}" --node "$bad" >/dev/null
devcluster="$(command -v recovery-devcluster)"
cat <<EOF

demo took $((SECONDS - t0)) s. The cluster is still running ($bad stays drained by us:
   scontrol update nodename=$bad state=resume   to give it back). Look around:
   eval "\$($devcluster env${cluster_args[*]:+ ${cluster_args[*]}})"
   RECOVERY_CONFIG=$config recovery-ctl audit --db $db
Stop it with:
   make down      (or: $devcluster down${cluster_args[*]:+ ${cluster_args[*]}})
EOF
echo "RECOVERED job=$recovered_job attempts=$attempts excluded=$excluded $timing"
