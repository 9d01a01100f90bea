#!/usr/bin/env bash
# Session 23, call 3: where the split path's list kernel spends its time, bit by bit (default) and searched by
# value (narrow: a third of the sums, the same kernel time): ncu source pages (SASS by region) of both.
# (Needs docs/experiments/topk_narrow_by_value.patch applied: the option was dropped after these runs.)
source "$(dirname "$0")/probe_common.sh"
probe_init session23_probe3
export PYTHONPATH="$PWD/src:$PWD"
for cfg in '{}' '{"narrow": true}'; do
  tag=$( [ "$cfg" = '{}' ] && echo bits || echo narrow )
  echo "== list kernel, $cfg" | tee -a $L
  timeout 150 ncu --clock-control none -k regex:_topk_list -s 1 -c 1 --set full --import-source yes -o /tmp/rep_$tag \
    python3 scripts/ncu_indexer.py --config "$cfg" topk_unsorted > $OUT/ncu_run_$tag.log 2>&1
  ncu -i /tmp/rep_$tag.ncu-rep --page source --csv --print-source sass > $OUT/list_sass_$tag.csv 2>/dev/null
  python3 scripts/ncu_sass_profile.py $OUT/list_sass_$tag.csv --window 40 --top 30 > $OUT/list_sass_profile_$tag.txt 2>&1
  head -45 $OUT/list_sass_profile_$tag.txt | tee -a $L
  ncu -i /tmp/rep_$tag.ncu-rep --page details 2>/dev/null | grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit" | tee -a $L
  rm -f $OUT/list_sass_$tag.csv
done
