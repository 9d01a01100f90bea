#!/usr/bin/env bash
# The tensor-memory gather against the 16-byte loads' ceiling (docs/perf.md, "Next device session
# (session 16's list)", item 1): its GPU test against the twin, then `benchmarks.gather` with the
# loads (carveout -1 and 0) and the tensor-memory copies at 2 and 4 stages, on the b=128 and b=64
# 16-head rows' index sets. One device call, ~3 minutes; logs and JSON under $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
L="$OUT/tma_gather_probe.log"
echo "== tests" | tee "$L"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gather_bench.py -rf 2>&1 | tail -4 | tee -a "$L"
for stages in 4 2; do
    echo "== benchmarks.gather --tma $stages" | tee -a "$L"
    timeout 200 python3 -m benchmarks.gather --quick --carveout -1 --carveout 0 --tma "$stages" \
        --json "$OUT/gather_tma$stages.json" 2>&1 | grep -v Warning | tee -a "$L"
done
