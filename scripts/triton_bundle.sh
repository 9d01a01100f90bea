#!/usr/bin/env bash
# Pack a Triton wheel into a tarball small enough to carry to a machine without network access
# (the GPU test machine has torch 2.11 + Triton 3.6; torch 2.14 users have Triton 3.8):
#
#   scripts/triton_bundle.sh triton-3.8.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl build/t38
#
# Writes build/t38/triton.tar.xz (~40 MB for 3.8.0): the package without the profiler library,
# the NVIDIA binaries (ptxas, cuobjdump, nvdisasm: take the machine's CUDA ones) and CUPTI;
# libtriton stripped. The wheel's Python tag must match the target's python3 (3.12 on the
# H200). On the target, `TRITON_BUNDLE=build/t38/triton.tar.xz scripts/gpu_check.sh` does the
# following itself:
#
#   mkdir -p /tmp/tn && tar -xJf build/t38/triton.tar.xz -C /tmp/tn
#   B=/tmp/tn/triton/backends/nvidia/bin; mkdir -p $B
#   for t in ptxas cuobjdump nvdisasm; do ln -sf "$(command -v $t || echo /usr/local/cuda/bin/$t)" $B/$t; done
#   PYTHONPATH=/tmp/tn:$PWD/src TRITON_CACHE_DIR=/tmp/tcn python3 -m pytest ...
#
# (the AMD backend stays in: backend discovery reads the installed Triton's entry points, which
# name it). Needs python3, strip and xz.
set -euo pipefail
wheel=$1
dest=${2:-build/triton_bundle}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m zipfile -e "$wheel" "$tmp"
rm -rf "$tmp/triton/_C/libproton.so" "$tmp/triton/backends/nvidia/bin" \
    "$tmp/triton/backends/nvidia/lib/cupti" "$tmp/triton/backends/nvidia/lib/cupti-blackwell"
find "$tmp/triton" -name __pycache__ -prune -exec rm -rf {} +
strip --strip-unneeded "$tmp/triton/_C/libtriton.so"
mkdir -p "$dest"
(cd "$tmp" && XZ_OPT="-9e -T0" tar -cJf - triton) > "$dest/triton.tar.xz"
ls -la "$dest/triton.tar.xz"
