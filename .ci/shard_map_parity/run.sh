#!/bin/bash
# Usage: run.sh V [plain|reprules|both]
# Runs JAX's tests/shard_map_test.py (extracted to /tmp/jaxtests/src/V from the JAX git mirror)
# with /tmp/venvs/jax-V, (a) plain: reprules not imported, its pytest11 plugin disabled;
# (b) reprules: plugin harness/reprules_active.py (import reprules, load all packs, register
# a rule for an unrelated Pallas kernel -> JAX patches installed) plus reprules' pytest plugin.
# reprules is imported from the snapshot /tmp/jaxtests/snapshot (a copy of /work/main/reprules).
set -u
V=$1; MODE=${2:-both}
H=/tmp/jaxtests
PY=/tmp/venvs/jax-$V/bin/python
mkdir -p $H/results
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_NUM_CPU_DEVICES=8
export PYTHONPATH=$H/harness:$H/snapshot PYTHONDONTWRITEBYTECODE=1
cd $H/src/$V
run() {
  local mode=$1; shift
  local start=$(date +%s)
  REPRULES_MARKER=$H/results/$V-$mode.marker.json nice -n 10 timeout 5400 $PY -m pytest tests/shard_map_test.py \
    -p no:cacheprovider -q -rA --junitxml=$H/results/$V-$mode.xml "$@" > $H/results/$V-$mode.log 2>&1
  local rc=$?
  echo "$V $mode rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a $H/results/timings.txt
}
if [ "$MODE" = plain ] || [ "$MODE" = both ]; then
  rm -f $H/results/$V-plain.marker.json
  run plain -p no:reprules
fi
if [ "$MODE" = reprules ] || [ "$MODE" = both ]; then
  rm -f $H/results/$V-reprules.marker.json
  run reprules -p reprules_active
fi
