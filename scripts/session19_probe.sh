#!/usr/bin/env bash
# Prepared in session 18 for the next device session: HopperConfig.narrow_rowsum (the 16/32-head consumer's row
# sums reduced once a request) where it is not yet the default: the MODEL1 cache's decode (one row measured 4.6 %
# slower with it, one 2.5 % faster) and the sparse prefill's narrow tiles (bf16 rows and the FP8 cache: never run
# with it). GPU tests with it as the default, then each benchmark with and without it, alternating; logs and JSON
# under $OUT. Carry build/pylib (pytest-xdist, as scripts/gpu_check.sh says) for parallel tests.
source "$(dirname "$0")/probe_common.sh"
probe_init session19_probe
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests, narrow_rowsum=1 as the default" | tee -a $L
probe_pytest 240 --hopper-config narrow_rowsum=1 tests/test_small_heads.py tests/test_prefill.py tests/test_gluon.py \
  -k "not test_gluon or partial_head_tile or extra_cache or model1 or lonely" | tail -3 | tee -a $L
for r in 1 2; do for v in 1 none; do
  echo "== MODEL1 small heads, narrow_rowsum=$v, run $r" | tee -a $L
  timeout 60 python3 -m benchmarks.decode --set small_heads --quick --only "d_qk=512" --hopper-config narrow_rowsum=$v \
    --json $OUT/small_heads_model1_rowsum${v}_${r}.json 2>&1 | grep -v Warn | tail -5 | tee -a $L
done; done
for v in 1 none; do
  echo "== prefill h_q 16 / 32, narrow_rowsum=$v" | tee -a $L
  timeout 120 python3 -m benchmarks.prefill --quick --only "h_q=16;h_q=32" --hopper-config narrow_rowsum=$v \
    --json $OUT/prefill_narrow_rowsum${v}.json 2>&1 | grep -v Warn | tail -6 | tee -a $L
done
