#!/usr/bin/env bash
# Session 22, call 1: the top-k's bisections two bits a step (the split path's sample and list, every
# list's remaining bits, the tie cut). GPU tests of the top-k, graph-replay A/B against HEAD (build/old:
# `git archive HEAD src | tar -x -C build/old`) and chunk / warp variants of the positions kernel, the
# split path on rows of 8K and 16K, ncu per-kernel durations. Carry build/pylib and build/old.
source "$(dirname "$0")/probe_common.sh"
probe_init session22_probe
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (top-k)" | tee -a $L
probe_pytest 200 tests/test_indexer.py -k "topk or bisect" | tail -4 | tee -a $L
echo "== A/B (graph replay), this tree" | tee -a $L
timeout 170 python3 scripts/topk_ab.py --quick --configs '[{"split": 0}, {}, {"split": 8192}, {"split_chunk": 8192}, {"split_chunk": 8192, "split_warps": 16}, {"split_chunk": 2048, "split_warps": 4}]' \
  --json $OUT/topk_ab_session22.json 2>&1 | grep -v Warn | tee -a $L
echo "== A/B (graph replay), HEAD" | tee -a $L
PYTHONPATH="$PWD/build/old/src:$PWD" timeout 60 python3 scripts/topk_ab.py --quick --configs '[{}]' 2>&1 | grep -v Warn | tee -a $L
echo "== ncu per-kernel durations (256 x 32768 unsorted)" | tee -a $L
timeout 100 ncu --clock-control none -k regex:_topk --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 scripts/ncu_indexer.py topk_unsorted 2>&1 | grep -E "_topk|duration|warps_active|dram__" | tail -16 | tee -a $L
