#!/usr/bin/env bash
# Session 20, calls 3 and 5 (NAME=session20_probe5): the GPU top-k tests, then scripts/topk_ab.py here and on
# HEAD (build/old/src = `git archive HEAD src`), twice, alternating. Call 3: the row loads with the first half
# unmasked (rows longer than half their power of two) and the list's bits by thirds; call 5: the candidate list
# as int32 positions. Carry build/pylib and build/old.
source "$(dirname "$0")/probe_common.sh"
probe_init ${NAME:-session20_probe3}
echo "== GPU tests" | tee -a $L
probe_pytest 200 tests/test_indexer.py tests/test_index_convert.py -k "topk or kvcache" | tail -3 | tee -a $L
for r in 1 2; do for src in "$PWD/src" "$PWD/build/old/src"; do
  v=$(basename $(dirname $src))
  echo "== topk_ab $v run $r" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 120 python3 scripts/topk_ab.py --quick --json "$OUT/topk_ab_${v}_${r}.json" 2>&1 \
    | grep -v Warn | tee -a $L
done; done
