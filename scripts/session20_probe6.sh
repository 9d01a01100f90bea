#!/usr/bin/env bash
# Session 20, call 6: compute-sanitizer memcheck on this session's kernel changes: the top-k's unmasked row loads and
# int32 position list (its register-path tests), and the narrow consumer's staged epilogue (the prefill on both kv forms).
source "$(dirname "$0")/probe_common.sh"
probe_init session20_probe6
export PYTHONPATH="$PWD/src:$PWD"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 480 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
  python3 -m pytest -q -p no:cacheprovider -p no:xdist "tests/test_indexer.py::test_topk_register_path_every_phase" \
  "tests/test_indexer.py::test_topk_random_rows_with_ties_match_twin" "tests/test_prefill.py::test_hopper_backend_on_both_kv_forms" \
  2>&1 | tail -8 | tee -a $L
echo "exit ${PIPESTATUS[0]}" | tee -a $L
