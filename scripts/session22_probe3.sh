#!/usr/bin/env bash
# Session 22, call 3: the split path from 8192 entries as the default: the indexer's GPU tests, serve-sim with
# the indexer, the public indexer benchmark, topk_ab's rows; then the list kernel's ncu source page (SASS by
# region: where its ~17 us go). Carry build/pylib.
source "$(dirname "$0")/probe_common.sh"
probe_init session22_probe3
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (indexer, index conversion)" | tee -a $L
probe_pytest 240 tests/test_indexer.py tests/test_index_convert.py | tail -3 | tee -a $L
echo "== serve-sim with the indexer" | tee -a $L
timeout 150 python3 -m sparse_mla serve-sim --device cuda --indexer --no-progress --json "$OUT/serve_sim_indexer_session22.json" 2>&1 \
  | grep -v Warn | tail -12 | tee -a $L
echo "== public benchmark" | tee -a $L
timeout 150 python3 -m benchmarks.indexer --quick --json $OUT/indexer_session22.json 2>&1 | grep -v Warn | tail -14 | tee -a $L
echo "== public benchmark, Triton launches (SPARSE_MLA_DIRECT_LAUNCH=0)" | tee -a $L
SPARSE_MLA_DIRECT_LAUNCH=0 timeout 150 python3 -m benchmarks.indexer --quick --json $OUT/indexer_session22_tritonlaunch.json 2>&1 | grep -v Warn | tail -14 | tee -a $L
echo "== ncu source page of the list kernel" | tee -a $L
timeout 120 ncu --clock-control none -k regex:_topk_list -s 1 -c 1 --set full --import-source yes -o /tmp/rep \
  python3 scripts/ncu_indexer.py topk_unsorted > $OUT/ncu_run.log 2>&1
ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > $OUT/list_sass.csv 2>/dev/null
python3 scripts/ncu_sass_profile.py $OUT/list_sass.csv --window 60 --top 25 > $OUT/list_sass_profile.txt 2>&1
head -60 $OUT/list_sass_profile.txt | tee -a $L
