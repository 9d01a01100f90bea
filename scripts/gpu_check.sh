#!/usr/bin/env bash
# GPU check: the whole test suite compiled on CUDA (real shapes in tests/decode/test_gpu.py, the Hopper
# kernel in tests/decode/test_gluon.py, the serving path in tests/api/test_serving_gpu.py), then the decode
# benchmark (BENCH_ARGS, e.g. --quick), the host time of eager calls, the prefill, dense decode (beside FlashMLA when
# `import flash_mla` finds it, e.g. PYTHONPATH=.anchors/flashmla), training and indexer benchmarks, the store benchmark and
# serve-sim at DeepSeek-V3.2 size (with random top-k positions, then with the indexer).
# Run on the device from the repo root; logs and the benchmarks' JSON go to $OUT (or ./gpu_out).
# Extra arguments go to pytest.
#
#   scripts/gpu_check.sh --indexer [--sweep [paged|prefill|topk]]
#     instead runs the indexer alone: the offline compile report of its kernels for this GPU's arch
#     (scripts/indexer_compile_check.py: registers, spills, wgmma/e4m3, cp.async; PTX in
#     $OUT/indexer_ptx), tests/indexer/test_indexer.py, then `python -m benchmarks.indexer --quick`; with
#     --sweep also the launch-parameter sweep (benchmarks/indexer_sweep.py; several minutes per
#     kernel: name one to stay inside a 10-minute call).
#
#   scripts/gpu_check.sh --memcheck [pytest args]
#     instead runs the small-shape kernel tests (every kernel, the view and corner cases of
#     tests/api/test_contract_edges.py included) under `compute-sanitizer --tool memcheck`, with
#     PyTorch's caching allocator off so that an access past a tensor is past its allocation;
#     fails on any memcheck error. Log: $OUT/memcheck.log.
#
#   TRITON_BUNDLE=build/t38/triton.tar.xz scripts/gpu_check.sh ...
#     runs everything under another Triton than the machine's (a tarball from
#     scripts/triton_bundle.sh, e.g. 3.8 as torch 2.14 pins): unpacked to /tmp/triton_bundle, the
#     machine's CUDA ptxas / cuobjdump / nvdisasm linked in, put first on PYTHONPATH, its own
#     kernel cache.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
source "$(dirname "$0")/triton_bundle_env.sh" || exit 3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "${1:-}" = "--indexer" ]; then
    arch=$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)")
    python3 scripts/indexer_compile_check.py --arch "$arch" --dump "$OUT/indexer_ptx" 2>&1 | tee "$OUT/indexer_compile.log"
    python3 -m pytest -q -p no:cacheprovider tests/indexer/test_indexer.py 2>&1 | tee "$OUT/pytest_indexer.log" | tail -25
    status=${PIPESTATUS[0]}
    python3 -m benchmarks.indexer --quick --json "$OUT/bench_indexer.json" 2>&1 | tee "$OUT/bench_indexer.log"
    if [ "${2:-}" = "--sweep" ]; then
        only=()
        [ -n "${3:-}" ] && only=(--only "$3")
        python3 -m benchmarks.indexer_sweep --quick "${only[@]}" --json "$OUT/indexer_sweep.json" 2>&1 | tee "$OUT/indexer_sweep.log"
    fi
    exit "$status"
fi
if [ "${1:-}" = "--memcheck" ]; then
    shift
    # small shapes only: memcheck slows every kernel by 10-100x
    tests=(tests/api/test_contract_edges.py tests/decode/test_workspace.py tests/decode/test_kernels.py tests/kvcache/test_store_kv.py tests/kvcache/test_index_convert.py
           tests/api/test_library.py "tests/decode/test_gluon.py::test_partial_head_tile" "tests/decode/test_gluon.py::test_topk_length_sink_nan"
           "tests/decode/test_gluon.py::test_lonely_rows_all_invalid" "tests/decode/test_gluon.py::test_odd_page_block_size"
           "tests/decode/test_gluon.py::test_extra_cache" "tests/decode/test_gluon.py::test_model1_partial_head_tile_and_odd_pages"
           "tests/prefill/test_prefill.py::test_corner_cases" "tests/prefill/test_prefill.py::test_hopper_bf16_rows_at_every_alignment"
           "tests/indexer/test_indexer.py::test_paged_logits_tensor_memory_path" "tests/indexer/test_indexer.py::test_paged_logits_corner_cases"
           "tests/indexer/test_indexer.py::test_nan_in_unused_cache_slots_never_reaches_the_logits"
           "tests/indexer/test_indexer.py::test_topk_register_path_every_phase" "tests/indexer/test_indexer.py::test_topk_random_rows_with_ties_match_twin")
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
        python3 -m pytest -q -p no:cacheprovider -p no:xdist "${tests[@]}" "${@}" 2>&1 | tee "$OUT/memcheck.log" | tail -25
    status=${PIPESTATUS[0]}
    grep -E "ERROR SUMMARY" "$OUT/memcheck.log" | tail -1
    exit "$status"
fi
# pytest-xdist where importable (JOBS workers, default 12): the suite takes about 5.5 min on an H200
# machine's 16 cores with 12. The device image has none; carry it as build/pylib, e.g.
#   mkdir -p build/pylib && cp -r "$(python -c 'import xdist, os; print(os.path.dirname(xdist.__path__[0]))')"/{xdist,execnet} build/pylib/
[ -d build/pylib ] && export PYTHONPATH="$PWD/build/pylib:$PYTHONPATH"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n ${JOBS:-12}"
python3 -m pytest -q -p no:cacheprovider $N tests/ "${@}" 2>&1 | tee "$OUT/pytest.log" | tail -25
status=${PIPESTATUS[0]}
python3 -m benchmarks.decode ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
python3 -m benchmarks.host --quick --json "$OUT/bench_host.json" 2>&1 | tee "$OUT/bench_host.log"
python3 -m benchmarks.prefill --quick --json "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.log"
python3 -m benchmarks.dense --quick --json "$OUT/bench_dense.json" 2>&1 | tee "$OUT/bench_dense.log"
python3 -m benchmarks.training --quick --json "$OUT/bench_training.json" 2>&1 | tee "$OUT/bench_training.log"
python3 -m benchmarks.indexer --quick --json "$OUT/bench_indexer.json" 2>&1 | tee "$OUT/bench_indexer.log"
python3 -m benchmarks.store --quick --json "$OUT/bench_store.json" > "$OUT/bench_store.log" 2>&1; tail -15 "$OUT/bench_store.log"
python3 -m sparse_mla serve-sim --device cuda --no-progress --json "$OUT/serve_sim.json" 2>&1 | tee "$OUT/serve_sim.log" | tail -16
python3 -m sparse_mla serve-sim --device cuda --indexer --no-progress --json "$OUT/serve_sim_indexer.json" 2>&1 | tee "$OUT/serve_sim_indexer.log" | tail -18
exit $status
