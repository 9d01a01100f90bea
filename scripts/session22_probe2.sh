#!/usr/bin/env bash
# Session 22, call 2: (1) the split path against the register path on rows of 8K-32K (where the default's
# `split` should be); (2) where the split path's list kernel spends its time (ncu source page, SASS by region);
# (3) scripts/split_staged_probe.sh's rows, trimmed to one run each (docs/experiments/narrow_split_staged.patch
# applied to the tree; build/old = `git archive HEAD src`). Carry build/pylib and build/old.
source "$(dirname "$0")/probe_common.sh"
probe_init session22_probe2
export PYTHONPATH="$PWD/src:$PWD"
echo "== top-k A/B: register path (split 0) against the split path from 8192 entries" | tee -a $L
timeout 120 python3 scripts/topk_ab.py --quick --configs '[{"split": 0}, {"split": 8192}]' \
  --json $OUT/topk_ab_rows_session22.json 2>&1 | grep -v Warn | tee -a $L
echo "== ncu source page of the list kernel" | tee -a $L
timeout 120 ncu --clock-control none -k regex:_topk_list -s 2 -c 1 --set full --import-source yes -o /tmp/rep \
  python3 scripts/ncu_indexer.py topk_unsorted > /dev/null 2>&1
ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > $OUT/list_sass.csv 2>/dev/null
python3 scripts/ncu_sass_profile.py $OUT/list_sass.csv --window 60 --top 25 2>&1 | tee $OUT/list_sass_profile.txt | head -120 | tee -a $L
echo "== GPU tests, narrow split partials staged" | tee -a $L
probe_pytest 200 tests/test_small_heads.py tests/test_gluon.py -k "not test_gluon or narrow or partial_head_tile or extra_cache or model1" \
  | tail -3 | tee -a $L
for src in "$PWD/src" "$PWD/build/old/src"; do
  v=$(basename $(dirname $src))
  echo "== small-head decode, $v" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 60 python3 -m benchmarks.decode --set small_heads --quick \
    --json "$OUT/small_heads_split_${v}.json" 2>&1 | grep -v Warn | grep -v "^results\|done " | tail -16 | tee -a $L
done
