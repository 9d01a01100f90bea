#!/usr/bin/env bash
# Prepared (session 23), not yet run: the split path's list finishing its k-th key on the few keys left in the found
# bits' range (TOPK_CONFIG["split_small"], docs/experiments/topk_list_small_tail.patch: apply it first). The
# indexer's GPU tests, topk_ab with split_small 0 / 128 / 256, each list kernel's time under ncu. Carry build/pylib.
source "$(dirname "$0")/probe_common.sh"
probe_init topk_small_tail
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (top-k)" | tee -a $L
probe_pytest 150 tests/test_indexer.py -k "topk or split" | tail -3 | tee -a $L
echo "== topk_ab" | tee -a $L
timeout 240 python3 scripts/topk_ab.py --quick --json $OUT/topk_ab_small_tail.json \
  --configs '[{}, {"split_small": 128}, {"split_small": 256}]' 2>&1 | grep -v Warn | tee -a $L
echo "== ncu: the list kernel" | tee -a $L
for cfg in '{}' '{"split_small": 128}' '{"split_small": 256}'; do
  echo "-- $cfg" | tee -a $L
  timeout 90 ncu --clock-control none -k regex:_topk_list -s 1 --metrics gpu__time_duration.sum,launch__registers_per_thread \
    python3 scripts/ncu_indexer.py --config "$cfg" topk_unsorted 2>&1 | grep -E "gpu__time|registers" | tee -a $L
done
