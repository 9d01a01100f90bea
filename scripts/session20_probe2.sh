#!/usr/bin/env bash
# Session 20, call 2: (a) GPU tests of the narrow consumer's staged epilogue (bf16-row prefill) and of the
# top-k's unmasked row loads and L2 prefetch; (b) the prefill rows against HEAD (build/old/src), alternating;
# (c) scripts/topk_ab.py here (configs) and on HEAD. Carry build/pylib and build/old.
source "$(dirname "$0")/probe_common.sh"
probe_init session20_probe2
OLD="$PWD/build/old/src"
echo "== GPU tests" | tee -a $L
probe_pytest 280 tests/test_prefill.py tests/test_small_heads.py tests/test_indexer.py -k "not paged or topk" \
  | tail -4 | tee -a $L
for src in "$PWD/src" "$OLD"; do
  echo "== topk_ab $src" | tee -a $L
  CFG='[{}, {"bisect_prefetch": true}, {"bisect_cap": 1}, {"bisect_cap": 4}, {"bisect_warps": 32}]'
  [ $src = "$OLD" ] && CFG='[{}]'
  PYTHONPATH="$src:$PWD" timeout 150 python3 scripts/topk_ab.py --quick --configs "$CFG" \
    --json "$OUT/topk_ab_$(basename $(dirname $src)).json" 2>&1 | grep -v Warn | tee -a $L
done
for r in 1 2; do for src in "$PWD/src" "$OLD"; do
  v=$(basename $(dirname $src))
  echo "== prefill rows, $v, run $r" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 100 python3 -m benchmarks.prefill --quick --only "h_q=128,s_kv=32768;h_q=64,d_qk=576;h_q=32;h_q=16" \
    --json "$OUT/prefill_${v}_${r}.json" 2>&1 | grep -v Warn | grep -v "^results" | tail -9 | tee -a $L
done; done
