#!/usr/bin/env bash
# Tuning sweep: one benchmark shape set per SPARSE_MLA_TUNE setting (device only).
#   bash benchmarks/sweep.sh "b=64,h_q=128" "BLOCK_N=64,num_warps=8" "BLOCK_N=32,num_warps=8" ...
set -u
only=$1; shift
for t in "$@"; do
  echo "### SPARSE_MLA_TUNE=$t"
  SPARSE_MLA_TUNE=$t python3 benchmarks/bench_decode.py --quick --only "$only" 2>&1 | tail -n +3
done
