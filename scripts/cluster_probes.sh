#!/usr/bin/env bash
# The 2-CTA cluster probes of issue 11's h_q 128 route (docs/experiments/cluster_*.py), run on an
# sm_90 GPU under a Triton >= 3.8 bundle from scripts/triton_bundle.sh (the machine's Triton 3.6
# has no async_store):
#
#   TRITON_BUNDLE=build/t38/triton.tar.xz scripts/cluster_probes.sh
#
# Prints each probe's verdict (the exchange, the ring with the cross-CTA release, the pair's QKᵀ,
# the producer timing solo vs pair); exit status 1 if any check fails.
set -uo pipefail
: "${TRITON_BUNDLE:?set TRITON_BUNDLE to a tarball from scripts/triton_bundle.sh}"
root=$PWD
source "$root/scripts/triton_bundle_env.sh" || exit 3
export PYTHONUNBUFFERED=1
python3 -c "import triton; print('triton', triton.__version__, triton.__file__)"
status=0
cd /tmp || exit 3
timeout 60 python3 "$root/docs/experiments/cluster_async_store_probe.py" pair-run || status=1
timeout 60 python3 "$root/docs/experiments/cluster_ring_probe.py" run || status=1
timeout 60 python3 "$root/docs/experiments/cluster_mma_probe.py" run || status=1
timeout 120 python3 "$root/docs/experiments/cluster_producer_bench.py" run 62 || status=1
# the draft kernel: the sparse prefill at h_q 128 from the FP8 cache with the pair sharing each tile
timeout 120 python3 "$root/docs/experiments/cluster_prefill_v32.py" check || status=1
timeout 120 python3 "$root/docs/experiments/cluster_prefill_v32.py" bench || status=1
exit $status
