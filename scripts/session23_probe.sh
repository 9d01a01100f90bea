#!/usr/bin/env bash
# Session 23: the top-k's bisections a histogram digit a step (TOPK_CONFIG["split_digit_bits"]): the indexer's
# GPU tests (the new digit tests and the split path with 0/5/8-bit steps), topk_ab of 0/5/6/8-bit steps and
# 8 list warps, then each split-path kernel's time under ncu for 0/5/6-bit steps. Carry build/pylib.
# (Needs docs/experiments/topk_histogram_digits.patch applied: the option was dropped after this run.)
source "$(dirname "$0")/probe_common.sh"
probe_init session23_probe
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (indexer)" | tee -a $L
probe_pytest 300 tests/test_indexer.py | tail -3 | tee -a $L
echo "== topk_ab" | tee -a $L
timeout 400 python3 scripts/topk_ab.py --quick --json $OUT/topk_ab_digit_session23.json --configs \
  '[{}, {"split_digit_bits": 5}, {"split_digit_bits": 6}, {"split_digit_bits": 8}, {"split_digit_bits": 5, "split_list_warps": 8}, {"split_digit_bits": 6, "split_list_warps": 8}]' \
  2>&1 | grep -v Warn | tee -a $L
echo "== ncu: each kernel of the second call" | tee -a $L
for cfg in '{}' '{"split_digit_bits": 5}' '{"split_digit_bits": 6}'; do
  echo "-- $cfg" | tee -a $L
  timeout 90 ncu --clock-control none -k regex:_topk -s 4 --metrics gpu__time_duration.sum \
    python3 scripts/ncu_indexer.py --config "$cfg" topk_unsorted 2>&1 | grep -E "^  _topk|gpu__time_duration" | tee -a $L
done
