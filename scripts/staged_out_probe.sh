#!/usr/bin/env bash
# Session 19: the sparse prefill's O stored through shared memory in 16-byte row pieces (_store_out_staged)
# against the commit before (its src carried as build/old): the prefill's GPU tests, then its rows, alternating.
source "$(dirname "$0")/probe_common.sh"
probe_init staged_out_probe
echo "== GPU tests: the sparse prefill" | tee -a $L
probe_pytest 140 tests/test_prefill.py | grep -v "^\s*$" | grep -v -i "warn" | tail -4 | tee -a $L
ROWS=${ROWS:-"h_q=128,s_kv=32768;h_q=64,d_qk=576;h_q=64,d_qk=512;h_q=32"}
for src in "$PWD/src" "$PWD/build/old/src"; do
  echo "== $src" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 70 python3 -m benchmarks.prefill --quick --only "$ROWS" \
    --json "$OUT/prefill_$(basename $(dirname $src)).json" 2>&1 | grep -v Warn | grep -v "^results" | tail -9 | tee -a $L
done
