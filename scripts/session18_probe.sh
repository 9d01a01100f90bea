#!/usr/bin/env bash
# Issue 11's L2-exchange route, its first question (docs/perf.md, session 17's list): what do 36 KB of
# global stores per block and CTA (the converted half-tile a head-pair CTA would hand its partner)
# cost the decode? One device call (timeouts sum to ~330 s), logs and JSON under $OUT (or ./gpu_out):
# the probe mode's GPU test (outputs unchanged), then graph-replay times of the default kernel beside
# PROFILE_L2_STORE (4) and the producer alone (1) on the V3.2 h_q 128 / 64 rows.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
L="$OUT/session18_probe.log"
echo "== L2-store probe: GPU test" | tee "$L"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gluon.py -k l2_store -rf 2>&1 | tail -3 | tee -a "$L"
echo "== V3.2 rows" | tee -a "$L"
timeout 210 python3 -m benchmarks.variants --graph \
    --only "b=64,h_q=128,d_qk=576,extra_topk=0,topk_len=False;b=128,h_q=128,d_qk=576,topk=2048;b=128,h_q=64,d_qk=576" \
    --variant base=hopper: --variant l2store=hopper:profile=4 --variant producer=hopper:profile=1 \
    --json "$OUT/variants_l2store.json" 2>&1 | grep -v Warning | tee -a "$L"
