#!/usr/bin/env bash
# Session 23, call 2: every list's k-th key (and the split path's threshold) searched by value
# (TOPK_CONFIG["narrow"]: two counts a sum about an interpolated target) against bit by bit: the indexer's
# GPU tests, topk_ab, then each split-path kernel's time under ncu. Carry build/pylib.
# (Needs docs/experiments/topk_narrow_by_value.patch applied: the option was dropped after these runs.)
source "$(dirname "$0")/probe_common.sh"
probe_init session23_probe2
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (indexer)" | tee -a $L
probe_pytest 300 tests/test_indexer.py | tail -3 | tee -a $L
echo "== topk_ab" | tee -a $L
timeout 300 python3 scripts/topk_ab.py --quick --json $OUT/topk_ab_narrow_session23.json --configs \
  '[{}, {"narrow": true}, {"narrow": true, "split_list_warps": 8}]' 2>&1 | grep -v Warn | tee -a $L
echo "== ncu: each kernel of the second call" | tee -a $L
for cfg in '{}' '{"narrow": true}' '{"narrow": true, "split_list_warps": 8}'; do
  echo "-- $cfg" | tee -a $L
  timeout 90 ncu --clock-control none -k regex:_topk -s 4 --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    python3 scripts/ncu_indexer.py --config "$cfg" topk_unsorted 2>&1 | grep -E "^  _topk|gpu__time|registers|warps_active" | tee -a $L
done
