#!/usr/bin/env bash
# Session 23, call 4: the split path's flagged rows done inside the list kernel (TOPK_CONFIG["split_inline"]: the
# radix select over the row from memory; no register-path launch after the list) against the launch after it:
# the indexer's GPU tests, topk_ab, ncu of the list kernel both ways. Carry build/pylib.
# (Its split_inline option became the only form in the commit after these runs.)
source "$(dirname "$0")/probe_common.sh"
probe_init session23_probe4
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (indexer)" | tee -a $L
probe_pytest 300 tests/test_indexer.py | tail -3 | tee -a $L
echo "== topk_ab" | tee -a $L
timeout 300 python3 scripts/topk_ab.py --quick --json $OUT/topk_ab_inline_session23.json --configs \
  '[{}, {"split_inline": true}, {}, {"split_inline": true}]' 2>&1 | grep -v Warn | tee -a $L
echo "== ncu: each kernel of the second call" | tee -a $L
for cfg in '{}' '{"split_inline": true}'; do
  echo "-- $cfg" | tee -a $L
  timeout 90 ncu --clock-control none -k regex:_topk -s 3 --metrics gpu__time_duration.sum,launch__registers_per_thread \
    python3 scripts/ncu_indexer.py --config "$cfg" topk_unsorted 2>&1 | grep -E "^  _topk|gpu__time|registers" | tee -a $L
done
