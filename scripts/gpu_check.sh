#!/usr/bin/env bash
# GPU check: the whole test suite compiled on CUDA (real shapes in tests/test_gpu.py), then the
# decode benchmark. Run on the device from the repo root; logs go to $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/ "${@}" 2>&1 | tee "$OUT/pytest.log" | tail -25
status=${PIPESTATUS[0]}
python3 benchmarks/bench_decode.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
exit $status
