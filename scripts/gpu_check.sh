#!/usr/bin/env bash
# GPU check: the whole test suite compiled on CUDA (real shapes in tests/test_gpu.py, the Gluon
# kernel in tests/test_gluon.py, the serving path in tests/test_serving_gpu.py), then the decode
# benchmark, the store benchmark and serve-sim at DeepSeek-V3.2 size. Run on the device from the
# repo root; logs go to $OUT (or ./gpu_out). Extra arguments go to pytest.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/ "${@}" 2>&1 | tee "$OUT/pytest.log" | tail -25
status=${PIPESTATUS[0]}
python3 benchmarks/bench_decode.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
python3 benchmarks/bench_store.py --quick --json "$OUT/bench_store.json" > "$OUT/bench_store.log" 2>&1; tail -15 "$OUT/bench_store.log"
python3 -m sparse_mla serve-sim --device cuda --no-progress --json "$OUT/serve_sim.json" 2>&1 | tee "$OUT/serve_sim.log" | tail -16
exit $status
