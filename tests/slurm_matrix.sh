#!/bin/bash
# The live suites against a newer Slurm: make test-slurm SLURM=24.11|26.05
# (docs/slurm-versions.md).
#
#   tests/slurm_matrix.sh VERSION [SUITE...]
#   tests/slurm_matrix.sh VERSION --run 'COMMAND' [rest]   (a shell command in there
#       instead, with the dev cluster up: RECOVERY_DEVCLUSTER_DIR, RECOVERY_TEST_PORT set)
#
# VERSION 24.11 runs in a debootstrap chroot of Debian trixie, 26.05 in one of
# sid (those releases' slurm-wlm, munge and libslurm-dev). 22.05 is this host's
# own Slurm: the same suites on a host dev cluster. SUITE is any of contract,
# recovery, spank, hooks, faults, rest, rest-loop (default: the first five). rest
# runs the dev cluster with slurmrestd and the CLI and REST contracts side by
# side; rest-loop (implies rest) adds the recovery loop with the agent on the
# REST backend.
#
# The chroot is built once and kept as a tarball in SLURM_CHROOT_CACHE
# (default build/slurm-chroots/), the virtualenv (the checkout installed
# editable, at /src) as a second tarball keyed by the pyproject files. Each run
# unpacks both into a scratch root, bind-mounts the checkout at /src and runs
# tests/slurm_matrix_inner.sh there in its own mount and pid namespaces (the
# host's network: pip reaches PyPI, and the dev cluster's ports are the host's,
# from SLURM_MATRIX_PORT, default 27817). Needs root, debootstrap and unshare.
#
# Environment: SLURM_CHROOT_CACHE, SLURM_CHROOT_SCRATCH (default
# /tmp/slurm-chroot-VERSION), RECOVERY_DEBIAN_MIRROR, SLURM_MATRIX_PORT,
# PYTEST_ARGS (passed on to pytest), BIN (the host virtualenv's bin/, 22.05).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
version=${1:?usage: slurm_matrix.sh VERSION [SUITE...]}
shift
run_cmd=
if [ "${1:-}" = --run ]; then   # --run 'COMMAND': that, on the dev cluster inside, not pytest
    run_cmd=${2:?usage: slurm_matrix.sh VERSION --run COMMAND}
    shift 2
fi
suites=${*:-contract recovery spank hooks faults}
rest=0 rest_loop=0
case " $suites " in *" rest "*) rest=1 ;; esac
case " $suites " in *" rest-loop "*) rest=1 rest_loop=1 ;; esac
cache=${SLURM_CHROOT_CACHE:-$repo/build/slurm-chroots}
mirror=${RECOVERY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
port=${SLURM_MATRIX_PORT:-27817}
packages="slurm-wlm slurmctld slurmd slurm-client munge libslurm-dev gcc make libc6-dev"
packages="$packages python3 python3-venv python3-dev procps ca-certificates"
packages="$packages slurmrestd slurm-wlm-jwt-plugin"

die() { printf 'slurm-matrix: %s\n' "$*" >&2; exit 1; }
say() { printf '== slurm-matrix %s: %s\n' "$version" "$*"; }

suite_files() {   # SUITE... -> the test files
    local s
    for s in "$@"; do
        case $s in
            contract) echo tests/integration/test_scheduler_contract*.py ;;
            recovery) echo tests/integration/test_recovery_live.py ;;
            spank) echo tests/integration/test_spank*.py ;;
            hooks) echo tests/integration/test_hooks_live.py ;;
            faults) echo tests/integration/test_faults_live.py ;;
            rest) echo tests/integration/test_scheduler_contract*.py ;;
            rest-loop) echo tests/integration/test_scheduler_contract*.py ;;
            *) die "unknown suite '$s' (contract recovery spank hooks faults rest rest-loop)" ;;
        esac
    done
}

# 22.05: the host's Slurm, the same suites on a host dev cluster
if [ "$version" = 22.05 ]; then
    bin=${BIN:-$repo/.venv/bin}
    state=${SLURM_MATRIX_STATE:-/tmp/slurm-matrix-host-$(id -u)}
    host=$(slurmctld -V 2>/dev/null | awk '{print $2}' || true)
    case $host in 22.05.*) ;; *) die "the host's Slurm is '${host:-missing}', not 22.05" ;; esac
    say "the host's Slurm $host, dev cluster on port $port"
    cd "$repo"
    # shellcheck disable=SC2046
    files=$(cd "$repo" && suite_files $suites | tr ' ' '\n' | sort -u)
    export RECOVERY_DEVCLUSTER_REST=$rest
    "$bin/recovery-devcluster" up --state-dir "$state" --port "$port"
    rc=0
    start=$SECONDS
    # shellcheck disable=SC2086
    RECOVERY_DEVCLUSTER_DIR=$state RECOVERY_TEST_PORT=$port RECOVERY_SPANK_TEST_PORT=$((port + 40)) \
        "$bin/python" -m pytest -p no:cacheprovider -q $files ${PYTEST_ARGS:-} || rc=$?
    if [ "$rest_loop" = 1 ]; then
        say "the recovery loop with the agent on the REST backend"
        # shellcheck disable=SC2086
        RECOVERY_DEVCLUSTER_DIR=$state RECOVERY_TEST_PORT=$port \
            RECOVERY_SCHEDULER_BACKEND=rest RECOVERY_SCHEDULER_REST_USER=$(id -un) \
            RECOVERY_SCHEDULER_REST_URL=http://127.0.0.1:$((port + 80)) \
            RECOVERY_SCHEDULER_REST_TOKEN_FILE=$state/etc/rest.token \
            "$bin/python" -m pytest -p no:cacheprovider -q tests/integration/test_recovery_live.py \
            ${PYTEST_ARGS:-} || rc=$?
    fi
    say "suites took $((SECONDS - start))s (rc=$rc)"
    "$bin/recovery-devcluster" down --state-dir "$state" || true
    exit $rc
fi

case $version in
    24.11) suite=trixie ;;
    26.05) suite=sid ;;
    *) die "no chroot for Slurm '$version' (22.05 = the host, 24.11 = trixie, 26.05 = sid)" ;;
esac
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mount namespaces)"
for tool in debootstrap unshare chroot tar; do
    command -v $tool >/dev/null || die "needs $tool (apt-get install debootstrap util-linux)"
done

# the chroot's name carries its package list: a changed list builds a new one
base=$cache/$suite-slurm-$(echo "$packages" | sha256sum | cut -c1-8).tar
key=$(cat "$repo/pyproject.toml" "$repo/tools/pyproject.toml" | sha256sum | cut -c1-16)
venv_tar=$cache/$suite-venv-$key.tar
scratch=${SLURM_CHROOT_SCRATCH:-/tmp/slurm-chroot-$version}
root=$scratch/root
mkdir -p "$cache"
t0=$SECONDS

build_base() {   # debootstrap + Debian's Slurm, into $base
    local tmp=$scratch/build log=$scratch/debootstrap.log
    if command -v curl >/dev/null &&
       ! curl -fsS -m 20 -o /dev/null "$mirror/dists/$suite/Release" 2>/dev/null; then
        die "cannot reach the Debian mirror $mirror (dists/$suite): the $suite chroot cannot be built (set RECOVERY_DEBIAN_MIRROR, or put a built $base in place)"
    fi
    say "building the $suite chroot (debootstrap from $mirror, a few minutes)"
    rm -rf "$tmp"; mkdir -p "$tmp"
    debootstrap --variant=minbase "$suite" "$tmp" "$mirror" >"$log" 2>&1 ||
        die "debootstrap $suite from $mirror failed (the mirror unreachable?): see $log"
    cp /etc/resolv.conf "$tmp/etc/resolv.conf"
    # a mirror snapshot's sid Release can be past its Valid-Until: accepted (a
    # throwaway test root; stable suites carry none)
    # no daemon starts while packages install (munge's postinst would start munged)
    printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
    chmod 755 "$tmp/usr/sbin/policy-rc.d"
    # shellcheck disable=SC2086
    unshare --mount --pid --fork --propagation private sh -ec "
        mount -t proc proc '$tmp/proc'
        chroot '$tmp' /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
            sh -ec 'apt-get -o Acquire::Check-Valid-Until=false update -qq && apt-get install -y -qq --no-install-recommends $packages && apt-get clean'
    " >>"$log" 2>&1 || die "installing Slurm in the $suite chroot failed (the mirror unreachable?): see $log"
    tar -C "$tmp" --exclude=./proc/* -cf "$base.part" . && mv "$base.part" "$base"
    rm -rf "$tmp"
    say "cached $base ($(du -h "$base" | cut -f1)) in $((SECONDS - t0))s"
}

if [ ! -f "$base" ]; then
    rm -f "$cache/$suite-slurm"*.tar
    build_base
fi

# a fresh scratch root each run: the cached tree, then the cached virtualenv
cleanup() {
    if grep -q " $root" /proc/mounts; then
        echo "slurm-matrix: mounts left under $root; not deleting it" >&2
    else
        rm -rf "$root"
    fi
}
rm -rf "$root"; mkdir -p "$root"
trap cleanup EXIT
tar -C "$root" -xf "$base"
[ ! -f "$venv_tar" ] || tar -C "$root" -xf "$venv_tar"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# slurmrestd runs as nobody; sid's minbase leaves that user to nss-systemd, which
# it lacks ("fatal: Unable to resolve user: nobody")
grep -q '^nobody:' "$root/etc/passwd" ||
    echo 'nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin' >>"$root/etc/passwd"
grep -q ':65534:' "$root/etc/group" || echo 'nogroup:x:65534:' >>"$root/etc/group"
# the host's name must resolve in there too: 24.11's slurmctld looks up the
# client's host to answer an RPC (an unresolvable one: "Unexpected message received")
cp /etc/hosts "$root/etc/hosts"
getent hosts "$(hostname)" >/dev/null || printf '127.0.1.1 %s\n' "$(hostname)" >>"$root/etc/hosts"
# the host's trust store (a site's own CA, a TLS-inspecting proxy): pip inside
# reaches PyPI as the host's pip does
[ ! -f /etc/ssl/certs/ca-certificates.crt ] ||
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
mkdir -p "$root/src"
say "scratch root ready in $((SECONDS - t0))s"

# shellcheck disable=SC2046
files=$(cd "$repo" && suite_files $suites | tr ' ' '\n' | sort -u | tr '\n' ' ')
rc=0
export MATRIX_RUN=$run_cmd
unshare --mount --pid --fork --propagation private sh -ec "
    mount -t proc proc '$root/proc'
    mount --rbind /dev '$root/dev'
    mount -t tmpfs tmpfs '$root/run'
    mount -t tmpfs tmpfs '$root/tmp'
    mount --bind '$repo' '$root/src'
    exec chroot '$root' /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LC_ALL=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt SLURM_WANT='$version' SLURM_MATRIX_PORT='$port' \
        VENV_KEY='$key' PYTEST_ARGS='${PYTEST_ARGS:-}' MATRIX_REST='$rest' MATRIX_REST_LOOP='$rest_loop' MATRIX_RUN=\"\$MATRIX_RUN\" \
        /bin/bash /src/tests/slurm_matrix_inner.sh $files
" || rc=$?

# the virtualenv the inner script made (first run, or after a pyproject change)
if [ ! -f "$venv_tar" ] && [ -f "$root/opt/venv/.key" ] &&
   [ "$(cat "$root/opt/venv/.key")" = "$key" ]; then
    rm -f "$cache/$suite-venv-"*.tar
    tar -C "$root" -cf "$venv_tar.part" opt/venv && mv "$venv_tar.part" "$venv_tar"
    say "cached the virtualenv as $venv_tar"
fi
say "done in $((SECONDS - t0))s (rc=$rc)"
exit $rc
