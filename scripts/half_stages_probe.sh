#!/usr/bin/env bash
# The 64-head tiles' 32-token ring stages (HopperConfig.half_stages, the MODEL1 decode's default since
# session 15, timed then only on a call without the extra cache) and their paired consumer steps
# (half_stage_pairs, never run yet): GPU tests first, then the MODEL1 rows in graph replay with and
# without half stages, then V3.2's 64-head rows with the pairs. One device call, ~6 minutes; logs and
# JSON under $OUT (or ./gpu_out). docs/perf.md, "Next device session (session 15's list)".
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
L="$OUT/half_stages_probe.log"
echo "== tests: half stages with and without pairs" | tee "$L"
timeout 150 python3 -m pytest -n 8 -q -p no:cacheprovider tests/test_gluon.py -k half_stages -rf 2>&1 | tail -6 | tee -a "$L"
echo "== MODEL1 rows, graph replay: the default (half stages on) / off" | tee -a "$L"
timeout 150 python3 -m benchmarks.decode --quick --only "d_qk=512" --json "$OUT/model1_half.json" 2>&1 | grep -v Warning \
    | tail -9 | tee -a "$L"
timeout 150 python3 -m benchmarks.decode --quick --only "d_qk=512" --hopper-config half_stages=0 \
    --json "$OUT/model1_nohalf.json" 2>&1 | grep -v Warning | tail -9 | tee -a "$L"
echo "== V3.2 64-head rows: paired steps, eager; producer / consumers alone beside" | tee -a "$L"
timeout 150 python3 -m benchmarks.variants --only "b=64,h_q=128,d_qk=576,topk=2048,topk_len=False;b=128,h_q=64,d_qk=576" \
    --variant base=hopper --variant pairs=hopper:half_stages=1,half_stage_pairs=1:check \
    --variant pairs_prod=hopper:half_stages=1,half_stage_pairs=1,profile=1 \
    --variant pairs_cons=hopper:half_stages=1,half_stage_pairs=1,profile=2 \
    --json "$OUT/variants_pairs.json" 2>&1 | grep -v Warning | tee -a "$L"
