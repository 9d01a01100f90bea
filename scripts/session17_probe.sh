#!/usr/bin/env bash
# The next device call (docs/perf.md, "Next device session (session 16's list)"), at most ~9
# minutes (timeouts below sum to 540 s), logs and JSON under $OUT (or ./gpu_out):
#  (1) the tensor-memory gather against the 16-byte loads' ceiling: its GPU test against the twin
#      (stops here if it fails: a wrong ring could hang), then `benchmarks.gather` with the loads
#      (carveout -1 and 0) and the copies at 4 stages, then the copies at 2 stages beside the loads
#      at -1 only, on the b=128 and b=64 16-head rows' index sets;
#  (2) the top-k register path under a register cap (64: two rows an SM; 72: the spills alone):
#      its GPU test, then the sweep's `bisect_maxnreg` configs beside the default.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
L="$OUT/session17_probe.log"
echo "== tensor-memory gather: tests" | tee "$L"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gather_bench.py -rf 2>&1 | tail -4 | tee -a "$L"
if [ "${PIPESTATUS[0]}" != 0 ]; then echo "tests failed: no gather benchmark" | tee -a "$L"; else
    echo "== benchmarks.gather --tma 4" | tee -a "$L"
    timeout 150 python3 -m benchmarks.gather --quick --carveout -1 --carveout 0 --tma 4 \
        --json "$OUT/gather_tma4.json" 2>&1 | grep -v Warning | tee -a "$L"
    echo "== benchmarks.gather --tma 2" | tee -a "$L"
    timeout 90 python3 -m benchmarks.gather --quick --carveout -1 --tma 2 \
        --json "$OUT/gather_tma2.json" 2>&1 | grep -v Warning | tee -a "$L"
fi
echo "== top-k under a register cap: tests" | tee -a "$L"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_indexer.py -k register_cap -rf 2>&1 | tail -3 | tee -a "$L"
timeout 140 python3 -m benchmarks.indexer_sweep --quick --only topk --match bisect_maxnreg \
    --json "$OUT/topk_maxnreg.json" 2>&1 | grep -v Warning | tee -a "$L"
