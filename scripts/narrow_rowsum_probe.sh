#!/usr/bin/env bash
# The narrow consumer's row sums kept per thread, reduced once after the last block (session 18): the narrow tiles'
# GPU tests, then benchmarks.decode --set small_heads alternating with the commit before (its src carried as
# build/old/src: `git archive HEAD src | tar -x -C build/old` before the change); logs and JSON under $OUT.
source "$(dirname "$0")/probe_common.sh"
probe_init narrow_rowsum
echo "== GPU tests" | tee -a $L
probe_pytest 200 tests/test_small_heads.py tests/test_gluon.py \
  -k "partial_head_tile or extra_cache or model1_partial or small or narrow or lonely or topk_length" | tail -3 | tee -a $L
ROWS="b=128,h_q=16,d_qk=576;b=128,h_q=32,d_qk=576;b=64,h_q=32,d_qk=576;b=2,h_q=32,d_qk=576;b=128,h_q=32,d_qk=512"
for r in 1 2; do for v in new old; do
  src="$PWD/src"; [ $v = old ] && src="$PWD/build/old/src"
  echo "== small heads, $v, run $r" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 70 python3 -m benchmarks.decode --set small_heads --quick --only "$ROWS" \
    --json $OUT/small_heads_${v}_${r}_session18.json 2>&1 | grep -v Warn | tail -9 | tee -a $L
done; done
