#!/usr/bin/env bash
# Runs pytest as N processes side by side, each on every Nth selected test (REPMLP_TEST_SHARD=K/N, which
# tests/conftest.py reads). benchmarks/gpu_check.sh runs the CUDA tier this way: a GPU machine has many
# cores and one GPU, its tests spend most of their time in Python, subprocesses and compiles, and it has no
# pytest-xdist.
#
#   benchmarks/pytest_shards.sh N PREFIX [pytest arguments...]
#
# Shard K (0-based) writes its output to PREFIX-K.log and its JUnit XML to PREFIX-K.xml, with a temporary
# folder of its own. When every shard has ended, the logs are printed in order. Killed early (by `timeout`,
# as gpu_check.sh does), the logs keep every test reported so far. Exit status: 0 when every shard passed (a
# shard left with no test counts as passed), else the first other status.
set -u
if [ $# -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: pytest_shards.sh N PREFIX [pytest arguments...]" >&2
    exit 2
fi
n=$1 prefix=$2
shift 2
PY=${PYTHON:-python3}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pytest-shards.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT
trap 'exit 143' TERM # killed (by `timeout`, whose signal reaches the shards too): still remove the folder
pids=()
for ((k = 0; k < n; k++)); do
    REPMLP_TEST_SHARD="$k/$n" "$PY" -m pytest "$@" --basetemp "$tmp/shard-$k" --junitxml "$prefix-$k.xml" \
        >"$prefix-$k.log" 2>&1 &
    pids+=($!)
done
rc=0
for ((k = 0; k < n; k++)); do
    wait "${pids[$k]}"
    status=$?
    [ "$status" = 5 ] && status=0 # pytest's "no tests collected": more shards than tests
    [ "$rc" = 0 ] && rc=$status
done
for ((k = 0; k < n; k++)); do
    echo "== shard $k/$n ($prefix-$k.log)"
    cat "$prefix-$k.log"
done
exit "$rc"
