#!/usr/bin/env bash
# Session 21, call 1: the top-k's split path (threshold from a sample, positions by chunk, the list,
# the register path for flagged rows). GPU tests of the indexer (the split path's own at small sizes,
# memcheck on them), then graph-replay A/B against the register path (split 0) with launch variants,
# and each kernel's device time under ncu. Carry build/pylib.
source "$(dirname "$0")/probe_common.sh"
probe_init session21_probe
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (indexer)" | tee -a $L
probe_pytest 240 tests/test_indexer.py | tail -4 | tee -a $L
echo "== memcheck, the split path's tests" | tee -a $L
PYTHONPATH="$PWD/build/pylib:$PWD/src:$PWD" timeout 200 compute-sanitizer --tool memcheck --print-limit 5 \
  python3 -m pytest -q -p no:cacheprovider tests/test_indexer.py -k "split_path" 2>&1 | tail -4 | tee -a $L
echo "== A/B (graph replay)" | tee -a $L
timeout 200 python3 scripts/topk_ab.py --quick --configs '[{"split": 0}, {}, {"split_warps": 4}, {"split_list_warps": 8}, {"split_sample_warps": 1}]' \
  --json $OUT/topk_ab_split.json 2>&1 | grep -v Warn | tee -a $L
echo "== ncu per-kernel durations (256 x 32768 unsorted)" | tee -a $L
timeout 120 ncu --clock-control none -k regex:_topk --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 scripts/ncu_indexer.py topk_unsorted 2>&1 | grep -E "_topk|duration|warps_active|registers|dram__" | tail -24 | tee -a $L
echo "== SPARSE_MLA_PDL=0 (no programmatic dependents)" | tee -a $L
SPARSE_MLA_PDL=0 timeout 100 python3 scripts/topk_ab.py --quick --configs '[{}]' 2>&1 | grep -v Warn | head -3 | tee -a $L
echo "== public benchmark" | tee -a $L
timeout 150 python3 -m benchmarks.indexer --quick --json $OUT/indexer_session21.json 2>&1 | grep -v Warn | tail -14 | tee -a $L
