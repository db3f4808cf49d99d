#!/bin/bash
# make resilience [RUNS=N] [SHARDS=S]: the campaign of docs/resilience.md.
# One share (the default): one pytest on one dev cluster, writing the table.
# S shares: S pytests at once, share K on a dev cluster of its own (state dir
# TEST_STATE_DIR-shareK, ports TEST_PORT + 5000*(K-1)); each writes its rows as
# JSON, and tests.resilience_merge joins them into the table. Exit status: the
# worst of the shares' (5, no test collected, fails too).
set -u
: "${BIN:?}" "${RUNS:=1}" "${SHARDS:=1}" "${TEST_STATE_DIR:?}" "${TEST_PORT:?}"
read -r -a extra <<< "${PYTEST_ARGS:-}"
if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "make resilience: SHARDS=$SHARDS: expected a whole number >= 1" >&2
    exit 2
fi

if [ "$SHARDS" -eq 1 ]; then
    "$BIN/recovery-devcluster" up --state-dir "$TEST_STATE_DIR" --port "$TEST_PORT" || exit 1
    rc=0
    RECOVERY_DEVCLUSTER_DIR="$TEST_STATE_DIR" RECOVERY_TEST_PORT="$TEST_PORT" \
        "$BIN/python" -m pytest -m resilience --resilience-report=docs/resilience.md \
        --resilience-runs="$RUNS" "${extra[@]}" || rc=$?
    "$BIN/recovery-devcluster" down --state-dir "$TEST_STATE_DIR"
    [ "$rc" -eq 5 ] && echo "pytest collected no tests: failing" >&2
    exit "$rc"
fi

# A background job starts with SIGINT ignored, and Python keeps it so: the shim
# gives pytest its Ctrl-C back (KeyboardInterrupt: fixtures torn down, clusters
# and agents stopped) before it execs it.
interruptible=("$BIN/python" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
os.execv(sys.argv[1], sys.argv[1:])' "$BIN/python")
declare -a dirs ports pids
for k in $(seq 1 "$SHARDS"); do
    dirs[k]="$TEST_STATE_DIR-share$k"
    ports[k]=$((TEST_PORT + 5000 * (k - 1)))
    "$BIN/recovery-devcluster" up --state-dir "${dirs[k]}" --port "${ports[k]}" || {
        for j in $(seq 1 "$k"); do "$BIN/recovery-devcluster" down --state-dir "${dirs[j]}"; done
        exit 1
    }
done
for k in $(seq 1 "$SHARDS"); do
    rm -f "${dirs[k]}.rows.json"
    echo "share $k/$SHARDS: dev cluster ${dirs[k]} (port ${ports[k]}), log ${dirs[k]}.log"
    RECOVERY_DEVCLUSTER_DIR="${dirs[k]}" RECOVERY_TEST_PORT="${ports[k]}" \
        "${interruptible[@]}" -m pytest -m resilience --resilience-shard="$k/$SHARDS" \
        --resilience-report="${dirs[k]}.rows.json" --resilience-runs="$RUNS" "${extra[@]}" \
        > "${dirs[k]}.log" 2>&1 &
    pids[k]=$!
done
# Ctrl-C or a TERM: every share is interrupted and tears down, then the clusters go
trap 'echo "make resilience: stopping the shares" >&2; kill -INT "${pids[@]}" 2>/dev/null' INT TERM
rc=0
for k in $(seq 1 "$SHARDS"); do
    while :; do wait "${pids[k]}"; status=$?; kill -0 "${pids[k]}" 2>/dev/null || break; done
    echo "share $k/$SHARDS: pytest exit $status; $(tail -n 1 "${dirs[k]}.log")"
    [ "$status" -eq 5 ] && echo "share $k collected no tests: failing" >&2
    [ "$status" -gt "$rc" ] && rc=$status
done
for k in $(seq 1 "$SHARDS"); do "$BIN/recovery-devcluster" down --state-dir "${dirs[k]}"; done
parts=()
for k in $(seq 1 "$SHARDS"); do parts+=("${dirs[k]}.rows.json"); done
"$BIN/python" -m tests.resilience_merge --runs "$RUNS" --out docs/resilience.md "${parts[@]}" \
    || { [ "$rc" -eq 0 ] && rc=1; }
exit "$rc"
