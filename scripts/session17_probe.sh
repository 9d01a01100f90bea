#!/usr/bin/env bash
# The next device call (docs/perf.md, "Next device session (session 16's list)"), ~5 minutes, logs
# and JSON under $OUT (or ./gpu_out): (1) the tensor-memory gather against the 16-byte loads'
# ceiling: its GPU test against the twin, then `benchmarks.gather` with the loads (carveout -1 and
# 0) and the tensor-memory copies at 4 and 2 stages, on the b=128 and b=64 16-head rows' index
# sets; (2) the top-k register path under a 64/72-register cap (two rows an SM): its GPU test,
# then the sweep's configs with `bisect_maxnreg` beside the default.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
L="$OUT/session17_probe.log"
echo "== tests" | tee "$L"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gather_bench.py -rf 2>&1 | tail -4 | tee -a "$L"
for stages in 4 2; do
    echo "== benchmarks.gather --tma $stages" | tee -a "$L"
    timeout 200 python3 -m benchmarks.gather --quick --carveout -1 --carveout 0 --tma "$stages" \
        --json "$OUT/gather_tma$stages.json" 2>&1 | grep -v Warning | tee -a "$L"
done
echo "== top-k under a register cap" | tee -a "$L"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_indexer.py -k register_cap -rf 2>&1 | tail -3 | tee -a "$L"
timeout 240 python3 -m benchmarks.indexer_sweep --quick --only topk --match bisect_maxnreg \
    --json "$OUT/topk_maxnreg.json" 2>&1 | grep -v Warning | tee -a "$L"
