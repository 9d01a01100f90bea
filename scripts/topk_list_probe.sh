#!/usr/bin/env bash
# The top-k's list phase four bits a step and the unsorted output written from the list (session 18): its GPU
# tests, then benchmarks.indexer alternating with the previous commit's src (build/old/src, `git archive HEAD src`
# before the change); logs and JSON under $OUT.
source "$(dirname "$0")/probe_common.sh"
probe_init topk_list
echo "== GPU tests" | tee -a $L
probe_pytest 300 tests/test_indexer.py tests/test_index_convert.py | tail -3 | tee -a $L
for r in 1 2; do for v in new old; do
  src="$PWD/src"; [ $v = old ] && src="$PWD/build/old/src"
  echo "== benchmarks.indexer, $v, run $r" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 150 python3 -m benchmarks.indexer --quick --json $OUT/indexer_${v}_${r}_session18.json 2>&1 \
    | grep -v Warn | grep -i "top" | tee -a $L
done; done
