#!/usr/bin/env bash
# Prepared in session 20 for the next device session: docs/experiments/narrow_split_staged.patch (the narrow
# consumer's split partials, fp32 Oᵀ, stored through the Q tile in two 256-column halves of 16-byte pieces; offline
# the 32-head build's split stores become 32 STG.E.128 instead of 128 STG.E, spills 120 -> 68 B). Before the call:
#   rm -rf build/old && mkdir -p build/old && git archive HEAD src | tar -x -C build/old && git apply docs/experiments/narrow_split_staged.patch
# then carry build/pylib and build/old. Runs the narrow GPU tests (split schedules included), then the small-head
# decode rows against HEAD, alternating; `git checkout src` afterwards.
source "$(dirname "$0")/probe_common.sh"
probe_init split_staged_probe
echo "== GPU tests" | tee -a $L
probe_pytest 200 tests/test_small_heads.py tests/test_gluon.py -k "not test_gluon or narrow or partial_head_tile or extra_cache or model1" \
  | tail -3 | tee -a $L
for r in 1 2; do for src in "$PWD/src" "$PWD/build/old/src"; do
  v=$(basename $(dirname $src))
  echo "== small-head decode, $v, run $r" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 60 python3 -m benchmarks.decode --set small_heads --quick \
    --json "$OUT/small_heads_split_${v}_${r}.json" 2>&1 | grep -v Warn | grep -v "^results\|done " | tail -16 | tee -a $L
done; done
