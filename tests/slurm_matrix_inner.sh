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

t=$SECONDS
if [ "$(cat $venv/.key 2>/dev/null)" != "$VENV_KEY" ]; then
    say "a virtualenv with the checkout (pip, from PyPI)"
    rm -rf $venv
    python3 -m venv $venv
    $venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    (cd /src && $venv/bin/python -m pip install -q --disable-pip-version-check \
        -e '.[test]' -e tools)
    echo "$VENV_KEY" >$venv/.key
    say "virtualenv ready in $((SECONDS - t))s"
fi
export PATH=$venv/bin:$PATH
# bytecode of this Python stays out of the checkout
export PYTHONPYCACHEPREFIX=/tmp/pycache

t=$SECONDS
mkdir -p $plugin_dir
make -s -C /src/spank PLUGIN=$plugin_dir/slurm_recovery.so >/dev/null ||
    die "the SPANK plugin does not build against Slurm $version's headers"
export RECOVERY_SPANK_PLUGIN=$plugin_dir/slurm_recovery.so
say "SPANK plugin built against $(dpkg-query -W -f='libslurm-dev ${Version}' libslurm-dev) in $((SECONDS - t))s"

cd /src
recovery-devcluster up --state-dir $state --port "$port"
rc=0
t=$SECONDS
# shellcheck disable=SC2086
# the SPANK suite's own two-node cluster inside our range too (P+40..P+43)
RECOVERY_DEVCLUSTER_DIR=$state RECOVERY_TEST_PORT=$port RECOVERY_SPANK_TEST_PORT=$((port + 40)) \
    python -m pytest -p no:cacheprovider -q "$@" ${PYTEST_ARGS:-} || rc=$?
say "suites took $((SECONDS - t))s (rc=$rc)"
recovery-devcluster down --state-dir $state >/dev/null 2>&1 || true
exit $rc
