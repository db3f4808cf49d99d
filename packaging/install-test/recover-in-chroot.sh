#!/bin/bash
# The install test's recovery scenario (tests/integration/test_install_chroot.py).
#
# Runs inside the test's Debian 12 chroot, where the .deb and Debian's slurmctld
# and slurmd are installed, in fresh network, mount and pid namespaces (so no
# port meets the host's, and every daemon dies with the scenario). Only the
# installed files are used: a dev cluster (the developer tools are no part of the
# package: the test copies tools/recovery_devtools to /tmp/src/tools, run here
# with the package's own interpreter),
# rewired to the installed hook wrappers, plugstack line and config; the agent
# started from its systemd unit's command line; a `sbatch --recovery` training
# job (examples/train.py, copied to /tmp/src) whose node loses a GPU (XID 79),
# is requeued without that node and finishes; then `recovery-ctl check`.
#
# Prints "RECOVERED job=ID restarts=N excluded=NODE" and exits 0 on success.
set -euo pipefail

state=/tmp/dc
unit=/lib/systemd/system/slurm-recovery-agent.service
prefix=/opt/slurm-recovery
train=/tmp/src/examples/train.py
agent_pid=
devcluster() { PYTHONPATH=/tmp/src/tools "$prefix/bin/python" -m recovery_devtools.devcluster "$@"; }

say() { printf '== %s\n' "$*"; }
die() {
    printf 'recover-in-chroot: %s\n' "$*" >&2
    [ ! -f /tmp/agent.log ] || tail -n 30 /tmp/agent.log >&2
    exit 1
}
wait_for() {   # SECONDS WHAT COMMAND...
    local limit=$1 what=$2 deadline=$((SECONDS + $1))
    shift 2
    until "$@"; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what"
        sleep 0.5
    done
}
field() { scontrol show job -o "$job" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
state_is() { [ "$(field JobState)" = "$1" ]; }
has_checkpoint() { grep -q 'checkpoint saved:' "$out" 2>/dev/null; }
agent_up() { python3 -c "import urllib.request; urllib.request.urlopen('$url/v1/health', timeout=1)" 2>/dev/null; }
finish() { [ -z "$agent_pid" ] || kill "$agent_pid" 2>/dev/null || true; devcluster down --state-dir "$state" >/dev/null 2>&1 || true; }
trap finish EXIT

say "a dev cluster, wired to the installed hooks, plugstack line and config"
devcluster up --nodes 3 --state-dir "$state"
eval "$(devcluster env --state-dir "$state")"
cp "$state/etc/recovery.toml" /etc/slurm-recovery/recovery.toml
sed -i -e "s|^Prolog=.*|Prolog=$prefix/libexec/prolog.sh|" \
       -e "s|^Epilog=.*|Epilog=$prefix/libexec/epilog.sh|" \
       -e "s|^HealthCheckProgram=.*|HealthCheckProgram=$prefix/libexec/healthcheck.sh|" \
       "$SLURM_CONF"
echo 'include /etc/slurm/plugstack.conf.d/*.conf' >"$state/etc/plugstack.conf"
scontrol reconfigure
grep -E '^(Prolog|Epilog|HealthCheckProgram)=' "$SLURM_CONF"
sbatch --help | grep -q -- '--recovery' || die "sbatch does not offer --recovery"

say "the agent, from $unit"
env_line=$(sed -n 's/^Environment=//p' "$unit")
exec_line=$(sed -n 's/^ExecStart=//p' "$unit")
echo "$env_line $exec_line"
# systemd would also give it StateDirectory=/var/lib/slurm-recovery; this config keeps its own
env $env_line $exec_line >/tmp/agent.log 2>&1 &
agent_pid=$!
url=$(sed -n 's/^agent_url = "\(.*\)"/\1/p' /etc/slurm-recovery/recovery.toml)
wait_for 60 "the agent's /v1/health" agent_up

say "a --recovery job loses a GPU"
mkdir -p "$state/jobs/ckpt"
job=$(cd "$state/jobs" && sbatch --parsable -N2 --ntasks-per-node=1 --requeue \
      --open-mode=append -o 'train-%j.out' --recovery=act:action \
      --wrap "srun --kill-on-bad-exit=1 /usr/bin/python3 $train --ckpt-dir $state/jobs/ckpt \
              --xid-log $state/nodes/{node}/kern.log --steps 200 --step-time 0.1 --ckpt-every 25")
job=${job%%;*}
out=$state/jobs/train-$job.out
wait_for 60 "job $job to run" state_is RUNNING
wait_for 60 "a first checkpoint" has_checkpoint
bad=$(scontrol show hostnames "$(field NodeList)" | sed -n 2p)
devcluster inject xid --state-dir "$state" --node "$bad" --gpu 0 --xid 79

say "the agent requeues job $job without $bad; it finishes"
wait_for 120 "job $job to finish" state_is COMPLETED
restarts=$(field Restarts)
excluded=$(field ExcNodeList)
[ "$restarts" -ge 1 ] || die "job $job completed without a restart"
[ "$excluded" = "$bad" ] || die "job $job excluded '$excluded', not $bad"
sinfo -h -n "$bad" -o '%T %E' | grep -q 'rcv:' || die "$bad was not drained by us"
recovery-ctl audit --job "$job"   # /usr/bin/recovery-ctl, the package's link

say "recovery-ctl check"
recovery-ctl check
echo "RECOVERED job=$job restarts=$restarts excluded=$excluded"
