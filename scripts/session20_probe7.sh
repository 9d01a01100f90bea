#!/usr/bin/env bash
# Session 20, call 7: (a) HopperConfig.narrow_staged_out=1 in the decode (the 16/32-head consumer's unsplit Oᵀ through
# the Q tile, as the bf16-row prefill now does): its GPU tests, then the small-head decode rows with and without
# it, alternating; (b) the top-k after the int32 position list: warps per row (scripts/topk_ab.py) and an ncu
# source view of the unsorted kernel (256 x 32768, k 2048). Carry build/pylib.
source "$(dirname "$0")/probe_common.sh"
probe_init session20_probe7
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests, narrow_staged_out=1 as the default" | tee -a $L
probe_pytest 200 --hopper-config narrow_staged_out=1 tests/test_small_heads.py tests/test_gluon.py \
  -k "not test_gluon or narrow or partial_head_tile or extra_cache or model1 or lonely" | tail -3 | tee -a $L
for r in 1 2; do for v in 1 none; do
  echo "== small-head decode, narrow_staged_out=$v, run $r" | tee -a $L
  timeout 60 python3 -m benchmarks.decode --set small_heads --quick --hopper-config narrow_staged_out=$v \
    --json $OUT/small_heads_staged${v}_${r}.json 2>&1 | grep -v Warn | grep -v "^results\|done " | tail -7 | tee -a $L
done; done
timeout 100 python3 scripts/topk_ab.py --quick --configs '[{}, {"bisect_warps": 32}, {"bisect_warps": 8}]' \
  --json $OUT/topk_ab_warps.json 2>&1 | grep -v Warn | tee -a $L
timeout 150 ncu --clock-control none -k regex:_topk -s 1 -c 1 --set full --import-source yes \
  -f -o "$OUT/topk_u" python3 scripts/ncu_indexer.py topk_unsorted > "$OUT/ncu_topk_u.log" 2>&1; echo "ncu rc $?" | tee -a $L
ncu -i "$OUT/topk_u.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_topk_u.csv" 2>/dev/null
python3 scripts/ncu_sass_profile.py "$OUT/sass_topk_u.csv" --window 100 --top 30 > "$OUT/profile_topk_u.txt"
ncu -i "$OUT/topk_u.ncu-rep" --page details --csv 2>/dev/null | grep -i "\"Duration\"\|Issue Slots Busy\|Local Memory Spilling Requests\"" | cut -d, -f13- | tee -a $L
rm -f "$OUT/topk_u.ncu-rep" "$OUT/sass_topk_u.csv"
