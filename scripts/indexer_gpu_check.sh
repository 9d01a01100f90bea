#!/usr/bin/env bash
# Indexer GPU check, one call on the device from the repo root: the offline compile report
# (registers, spills, wgmma/e4m3, cp.async of the indexer kernels for this GPU's arch), the
# indexer tests compiled on CUDA, then `python -m benchmarks.indexer --quick`.
# Logs and JSON go to $OUT (or ./gpu_out).
#
#   scripts/indexer_gpu_check.sh            tests + benchmark (a few minutes)
#   scripts/indexer_gpu_check.sh --sweep [paged|prefill|topk]
#                                           also the launch-parameter sweep (benchmarks/indexer_sweep.py;
#                                           several minutes per kernel: name one to stay in a 10-minute call)
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
arch=$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)")
python3 scripts/indexer_compile_check.py --arch "$arch" --dump "$OUT/indexer_ptx" 2>&1 | tee "$OUT/indexer_compile.log"
python3 -m pytest -q -p no:cacheprovider tests/test_indexer.py 2>&1 | tee "$OUT/pytest_indexer.log" | tail -25
status=${PIPESTATUS[0]}
python3 -m benchmarks.indexer --quick --json "$OUT/bench_indexer.json" 2>&1 | tee "$OUT/bench_indexer.log"
if [ "${1:-}" = "--sweep" ]; then
    only=()
    [ -n "${2:-}" ] && only=(--only "$2")
    python3 -m benchmarks.indexer_sweep --quick "${only[@]}" --json "$OUT/indexer_sweep.json" 2>&1 | tee "$OUT/indexer_sweep.log"
fi
exit $status
