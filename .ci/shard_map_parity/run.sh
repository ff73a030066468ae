#!/bin/bash
# Usage: run.sh V [plain|reprules|both] [TAG TESTFILE...]
# Runs JAX's tests/shard_map_test.py, or the TESTFILEs with results named TAG-V-MODE
# (extracted to /tmp/jaxtests/src/V from the JAX git mirror)
# with /tmp/venvs/jax-V, (a) plain: reprules not imported, its pytest11 plugin disabled;
# (b) reprules: plugin harness/reprules_active.py (import reprules, load all packs, register
# a rule for an unrelated Pallas kernel -> JAX patches installed) plus reprules' pytest plugin.
# reprules is imported from the snapshot /tmp/jaxtests/snapshot (a copy of /work/main/reprules).
set -u
V=$1; MODE=${2:-both}; TAG=${3:-}
if [ -n "$TAG" ]; then shift 3; TESTS=("$@"); NAME=$TAG-$V; else TESTS=(tests/shard_map_test.py); NAME=$V; fi
H=/tmp/jaxtests
PY=/tmp/venvs/jax-$V/bin/python
mkdir -p $H/results
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_NUM_CPU_DEVICES=8
export PYTHONPATH=$H/harness:$H/snapshot PYTHONDONTWRITEBYTECODE=1
cd $H/src/$V
run() {
  local mode=$1; shift
  local start=$(date +%s)
  REPRULES_MARKER=$H/results/$NAME-$mode.marker.json nice -n 10 timeout 5400 $PY -m pytest "${TESTS[@]}" \
    -p no:cacheprovider -q -rA --junitxml=$H/results/$NAME-$mode.xml "$@" > $H/results/$NAME-$mode.log 2>&1
  local rc=$?
  echo "$NAME $mode rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a $H/results/timings.txt
}
if [ "$MODE" = plain ] || [ "$MODE" = both ]; then
  rm -f $H/results/$NAME-plain.marker.json
  run plain -p no:reprules
fi
if [ "$MODE" = reprules ] || [ "$MODE" = both ]; then
  rm -f $H/results/$NAME-reprules.marker.json
  run reprules -p reprules_active
fi
