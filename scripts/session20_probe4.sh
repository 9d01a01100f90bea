#!/usr/bin/env bash
# Session 20, call 4: the public indexer calls (benchmarks.indexer --quick: paged and prefill logits, top-k),
# an ncu source view of the unsorted top-k (256 x 32768, k 2048), and the small-batch decode rows (issue 13).
source "$(dirname "$0")/probe_common.sh"
probe_init session20_probe4
export PYTHONPATH="$PWD/src:$PWD"
echo "== benchmarks.indexer --quick" | tee -a $L
timeout 200 python3 -m benchmarks.indexer --quick --json $OUT/indexer_session20.json 2>&1 | grep -v Warn | tee -a $L
echo "== ncu unsorted top-k" | tee -a $L
timeout 200 ncu --clock-control none -k regex:_topk -s 1 -c 1 --set full --import-source yes \
  -f -o "$OUT/topk_u" python3 scripts/ncu_indexer.py topk_unsorted > "$OUT/ncu_topk_u.log" 2>&1; echo "ncu rc $?" | tee -a $L
ncu -i "$OUT/topk_u.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_topk_u.csv" 2>/dev/null
python3 scripts/ncu_sass_profile.py "$OUT/sass_topk_u.csv" --window 100 --top 30 > "$OUT/profile_topk_u.txt"
head -4 "$OUT/profile_topk_u.txt" | tee -a $L
ncu -i "$OUT/topk_u.ncu-rep" --page details --csv 2>/dev/null | grep -i "\"Duration\"\|Issue Slots Busy\|Local Memory Spilling Requests\"" | cut -d, -f13- | tee -a $L
rm -f "$OUT/topk_u.ncu-rep"
echo "== small-batch decode rows" | tee -a $L
timeout 150 python3 -m benchmarks.decode --quick --only "b=1;b=2" --json $OUT/decode_small_b_session20.json 2>&1 \
  | grep -v Warn | tail -6 | tee -a $L
