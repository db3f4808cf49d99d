#!/bin/bash
# Inside the Slurm chroot of tests/slurm_matrix.sh: the checkout is at /src (read-write),
# /run and /tmp are fresh. A virtualenv with the checkout installed (made once, then
# cached by the caller), the SPANK plugin built against this release's headers (outside
# the checkout: the host's spank/slurm_recovery.so stays the 22.05 build), a dev cluster,
# and pytest over the files given as arguments.
set -euo pipefail

venv=/opt/venv
state=/tmp/dc
plugin_dir=/opt/slurm-recovery-spank
port=${SLURM_MATRIX_PORT:?}
say() { printf '== slurm-matrix %s (in the chroot): %s\n' "$SLURM_WANT" "$*"; }
die() { printf 'slurm-matrix: %s\n' "$*" >&2; exit 1; }

version=$(slurmctld -V | awk '{print $2}')
case $version in
    "$SLURM_WANT".*) say "Slurm $version" ;;
    *) die "the chroot's Slurm is $version, not $SLURM_WANT (the Debian suite moved on?)" ;;
esac

# bytecode of this Python stays out of the checkout
export PYTHONPYCACHEPREFIX=/tmp/pycache

# pip install -e writes <name>.egg-info into the source tree, and the host's wheel
# build (make install, make deb) would then pick up this setuptools' files: while pip
# runs, each egg-info directory is a tmpfs of this mount namespace only
hide_egg_info() {
    local egg
    for egg in /src/slurm_recovery.egg-info /src/tools/slurm_recovery_devtools.egg-info; do
        if [ ! -d "$egg" ]; then mkdir "$egg"; made_eggs="$made_eggs $egg"; fi
        mount -t tmpfs tmpfs "$egg"
        mounted_eggs="$mounted_eggs $egg"
    done
}
show_egg_info() {
    local egg
    for egg in $mounted_eggs; do umount "$egg"; done
    for egg in $made_eggs; do rmdir "$egg"; done
    mounted_eggs= made_eggs=
}
mounted_eggs= made_eggs=

t=$SECONDS
if [ "$(cat $venv/.key 2>/dev/null)" != "$VENV_KEY" ]; then
    say "a virtualenv with the checkout (pip, from PyPI)"
    rm -rf $venv
    python3 -m venv $venv
    $venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    hide_egg_info
    trap show_egg_info EXIT
    (cd /src && $venv/bin/python -m pip install -q --disable-pip-version-check \
        -e '.[test]' -e tools)
    show_egg_info
    trap - EXIT
    echo "$VENV_KEY" >$venv/.key
    say "virtualenv ready in $((SECONDS - t))s"
fi
export PATH=$venv/bin:$PATH

t=$SECONDS
mkdir -p $plugin_dir
make -s -C /src/spank PLUGIN=$plugin_dir/slurm_recovery.so >/dev/null ||
    die "the SPANK plugin does not build against Slurm $version's headers"
export RECOVERY_SPANK_PLUGIN=$plugin_dir/slurm_recovery.so
say "SPANK plugin built against $(dpkg-query -W -f='libslurm-dev ${Version}' libslurm-dev) in $((SECONDS - t))s"

cd /src
# the rest suite: slurmrestd too (jwt on port+80, munge on a local socket)
export RECOVERY_DEVCLUSTER_REST=${MATRIX_REST:-0}
recovery-devcluster up --state-dir $state --port "$port"
rc=0
t=$SECONDS
if [ -n "${MATRIX_RUN:-}" ]; then
    RECOVERY_DEVCLUSTER_DIR=$state RECOVERY_TEST_PORT=$port SLURM_CONF=$state/etc/slurm.conf \
        bash -c "$MATRIX_RUN" || rc=$?
    say "the command took $((SECONDS - t))s (rc=$rc)"
    recovery-devcluster down --state-dir $state >/dev/null 2>&1 || true
    exit $rc
fi
# shellcheck disable=SC2086
# the SPANK suite's own two-node cluster inside our range too (P+40..P+43)
RECOVERY_DEVCLUSTER_DIR=$state RECOVERY_TEST_PORT=$port RECOVERY_SPANK_TEST_PORT=$((port + 40)) \
    python -m pytest -p no:cacheprovider -q "$@" ${PYTEST_ARGS:-} || rc=$?
if [ "${MATRIX_REST_LOOP:-0}" = 1 ]; then
    say "the recovery loop with the agent on the REST backend"
    # shellcheck disable=SC2086
    RECOVERY_DEVCLUSTER_DIR=$state RECOVERY_TEST_PORT=$port \
        RECOVERY_SCHEDULER_BACKEND=rest RECOVERY_SCHEDULER_REST_USER=$(id -un) \
        RECOVERY_SCHEDULER_REST_URL=http://127.0.0.1:$((port + 80)) \
        RECOVERY_SCHEDULER_REST_TOKEN_FILE=$state/etc/rest.token \
        python -m pytest -p no:cacheprovider -q tests/integration/test_recovery_live.py \
        ${PYTEST_ARGS:-} || rc=$?
fi
say "suites took $((SECONDS - t))s (rc=$rc)"
if [ "$rc" != 0 ]; then
    # the daemons' and the agent's logs outlive this root's /tmp: where a failure is read
    keep=/src/build/slurm-matrix-logs/$SLURM_WANT
    rm -rf "$keep"; mkdir -p "$keep"
    cp -r $state/log/. "$keep/" 2>/dev/null || true
    say "logs kept in ${keep#/src/}"
fi
recovery-devcluster down --state-dir $state >/dev/null 2>&1 || true
exit $rc
