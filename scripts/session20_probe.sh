#!/usr/bin/env bash
# Session 20, call 1. (a) The prepared narrow-consumer staged epilogue (then docs/experiments/prefill_narrow_staged_out.patch, landed for the bf16-row prefill after call 2,
# applied in build/new/src; build/old/src = HEAD): the prefill and small-head GPU tests with it, then the 32/16-head
# prefill rows, alternating with HEAD. (b) The top-k register path at 256 rows x 32K: its timing stops
# (benchmarks.indexer_sweep --match profile) and one ncu source view of the kernel. Carry build/pylib, build/old, build/new.
source "$(dirname "$0")/probe_common.sh"
probe_init session20_probe
NEW="$PWD/build/new/src"; OLD="$PWD/build/old/src"
echo "== GPU tests with the narrow staged epilogue" | tee -a $L
PYTHONPATH="$PWD/build/pylib:$NEW:$PWD" timeout 200 python3 -m pytest -q -p no:cacheprovider $N \
  tests/test_prefill.py tests/test_small_heads.py -rf 2>&1 | tail -3 | tee -a $L
for r in 1 2; do for src in "$NEW" "$OLD"; do
  v=$(basename $(dirname $src))
  echo "== prefill h_q 32 / 16, $v, run $r" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 90 python3 -m benchmarks.prefill --quick --only "h_q=32;h_q=16" \
    --json "$OUT/prefill_narrow_${v}_${r}.json" 2>&1 | grep -v Warn | grep -v "^results" | tail -5 | tee -a $L
done; done
export PYTHONPATH="$PWD/src:$PWD"
echo "== top-k stops (256 x 32K, k 2048)" | tee -a $L
timeout 150 python3 -m benchmarks.indexer_sweep --quick --only topk --match "profile" --json $OUT/topk_stops.json 2>&1 \
  | grep -v Warn | tee -a $L
echo "== ncu top-k" | tee -a $L
timeout 200 ncu --clock-control none -k regex:_topk -s 1 -c 1 --set full --import-source yes \
  -f -o "$OUT/topk" python3 scripts/ncu_indexer.py topk > "$OUT/ncu_topk.log" 2>&1; echo "ncu rc $?" | tee -a $L
tail -3 "$OUT/ncu_topk.log"
ncu -i "$OUT/topk.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_topk.csv" 2>/dev/null
python3 scripts/ncu_sass_profile.py "$OUT/sass_topk.csv" --window 100 --top 40 > "$OUT/profile_topk.txt"
head -80 "$OUT/profile_topk.txt"
ncu -i "$OUT/topk.ncu-rep" --page details --csv 2>/dev/null > "$OUT/details_topk.csv"
grep -i "Duration\|Issue Slots Busy\|SM Busy\|Registers\|Memory Throughput\|DRAM Through\|Local" "$OUT/details_topk.csv" | head -16
rm -f "$OUT/topk.ncu-rep"
