#!/usr/bin/env bash
# Nsight Compute source view of the sparse prefill's Hopper kernel (bf16 rows, h_q 64, s_q 4096, topk 2048,
# s_kv 32K: benchmarks.prefill's row), one launch: stall samples by SASS line, summarised by
# scripts/ncu_sass_profile.py. Extra --hopper-config settings in $CFG (e.g. profile=2: the consumers alone).
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
set -uo pipefail
export PYTHONPATH="$PWD/src:$PWD"
TAG=${TAG:-whole}
cat > "$OUT/drive.py" <<'PY'
import os, torch, sparse_mla as flash_mla
from benchmarks.prefill import PrefillShape, make_inputs
from benchmarks.variants import set_hopper_default
if os.environ.get("CFG"):
    set_hopper_default(os.environ["CFG"])
s = PrefillShape(4096, int(os.environ.get("HQ", "64")), 2048, 576, 32768)
inp = make_inputs(s)
for _ in range(3):
    flash_mla.flash_mla_sparse_fwd(inp["q"], inp["kv"], inp["indices"], 576**-0.5, attn_sink=inp["sink"])
torch.cuda.synchronize()
PY
timeout 400 ncu --clock-control none -k regex:_sparse_decode_gluon_kernel -s 2 -c 1 --set full --import-source yes \
  -f -o "$OUT/prefill_$TAG" python3 "$OUT/drive.py" > "$OUT/ncu_$TAG.log" 2>&1; echo "ncu rc $?"
tail -3 "$OUT/ncu_$TAG.log"
ncu -i "$OUT/prefill_$TAG.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$TAG.csv" 2>/dev/null
python3 scripts/ncu_sass_profile.py "$OUT/sass_$TAG.csv" --window 100 --top 40 > "$OUT/profile_$TAG.txt"
head -60 "$OUT/profile_$TAG.txt"
ncu -i "$OUT/prefill_$TAG.ncu-rep" --page details --csv 2>/dev/null | grep -i "Duration\|Issue Slots Busy\|Tensor\|SM Busy\|Registers" | head -12
rm -f "$OUT/prefill_$TAG.ncu-rep"
