#!/usr/bin/env bash
# Does the L1 left beside the shared memory bound the 16-head decode's gathers? (issue 12; docs/perf.md,
# "Next device session (session 14's list)"). Triton gives every kernel past 48 KB of shared memory the
# largest carveout (28 KB of L1 on Hopper); HopperConfig.smem_carveout / benchmarks.gather --carveout
# hint another one. One device call, ~5 minutes; logs and JSON under $OUT (or ./gpu_out).
#
#   scripts/l1_probe.sh            # all steps
#   NCU=0 scripts/l1_probe.sh      # without the two ncu runs
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
row="b=128,h_q=16,d_qk=576"
echo "== the carveout hint's and P-in-stage's GPU tests" | tee "$OUT/l1_probe.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gluon.py -k "carveout or p_in_stage" 2>&1 | tail -3 \
    | tee -a "$OUT/l1_probe.log"
echo "== bare gather: driver default, the most shared memory (28 KB of L1), the least" | tee -a "$OUT/l1_probe.log"
timeout 240 python3 -m benchmarks.gather --quick --only "$row" --carveout -1 --carveout 100 --carveout 0 \
    --json "$OUT/gather_carveout.json" 2>&1 | grep -v Warning | tee -a "$OUT/l1_probe.log"
# the 16-head decode: default; the smallest carveout that fits (196 KB: 60 KB of L1); Pᵀ in the stage
# (166.7 KB of shared memory: 164 KB, 92 KB of L1 with the hint)
echo "== the 16-head decode at three L1 sizes" | tee -a "$OUT/l1_probe.log"
timeout 200 python3 -m benchmarks.variants --set small_heads --only "$row;b=64,h_q=16,d_qk=576;b=128,h_q=8,d_qk=576" \
    --variant base=hopper --variant c0=hopper:smem_carveout=0:check --variant base_prod=hopper:profile=1 \
    --variant c0_prod=hopper:smem_carveout=0,profile=1 --variant p=hopper:narrow_p_in_stage=1:check \
    --variant p_c0=hopper:narrow_p_in_stage=1,smem_carveout=0:check \
    --variant p_c0_prod=hopper:narrow_p_in_stage=1,smem_carveout=0,profile=1 \
    --json "$OUT/variants_carveout.json" 2>&1 | grep -v Warning | tee -a "$OUT/l1_probe.log"
if [ "${NCU:-1}" != 0 ] && command -v /usr/local/cuda/bin/ncu >/dev/null; then
    for c in -1 0; do
        echo "== ncu, producer alone, carveout $c" | tee -a "$OUT/l1_probe.log"
        timeout 150 /usr/local/cuda/bin/ncu --clock-control none -k regex:gluon --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
            python3 -m benchmarks.profile --b 128 --h-q 16 --profile-mode 1 --smem-carveout "$c" \
            > "$OUT/ncu_h16_producer_carveout$c.txt" 2>&1
        grep -E "Duration|L1/TEX Hit|Mem Busy|Max Bandwidth|Stall Long|Stall LG|Shared Memory Configuration|Driver Shared" \
            "$OUT/ncu_h16_producer_carveout$c.txt" | head -20 | tee -a "$OUT/l1_probe.log"
    done
fi
