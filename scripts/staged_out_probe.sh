#!/usr/bin/env bash
# Session 19: the sparse prefill's O stored through shared memory in 16-byte row pieces (_store_out_staged)
# against the commit before (its src carried as build/old): the prefill's GPU tests, then its rows, alternating.
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
set -uo pipefail
export PYTHONUNBUFFERED=1
L=$OUT/staged_out_probe.log
N=""; PYTHONPATH="$PWD/build/pylib" python3 -c "import xdist" 2>/dev/null && N="-n 8"
echo "== GPU tests: the sparse prefill" | tee $L
PYTHONPATH="$PWD/build/pylib:$PWD/src:$PWD" timeout 140 python3 -m pytest -q -p no:cacheprovider $N tests/test_prefill.py \
  -rf 2>&1 | grep -v "^\s*$" | grep -v -i "warn" | tail -4 | tee -a $L
ROWS=${ROWS:-"h_q=128,s_kv=32768;h_q=64,d_qk=576;h_q=64,d_qk=512;h_q=32"}
for src in "$PWD/src" "$PWD/build/old/src"; do
  echo "== $src" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 70 python3 -m benchmarks.prefill --quick --only "$ROWS" \
    --json "$OUT/prefill_$(basename $(dirname $src)).json" 2>&1 | grep -v Warn | grep -v "^results" | tail -9 | tee -a $L
done
