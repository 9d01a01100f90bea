# Sourced by scripts/gpu_check.sh: when TRITON_BUNDLE names a
# tarball from scripts/triton_bundle.sh, unpack it to /tmp/triton_bundle, link the machine's CUDA
# ptxas / cuobjdump / nvdisasm into it (the bundle leaves its own out), put it first on PYTHONPATH
# and give it its own kernel cache. Returns 3 if the tarball cannot be unpacked.
if [ -n "${TRITON_BUNDLE:-}" ]; then
    tb=/tmp/triton_bundle
    rm -rf "$tb" && mkdir -p "$tb" && tar -xJf "$TRITON_BUNDLE" -C "$tb" || { echo "cannot unpack $TRITON_BUNDLE"; return 3; }
    mkdir -p "$tb/triton/backends/nvidia/bin"
    for t in ptxas cuobjdump nvdisasm; do
        p=$(command -v "$t" || ls /usr/local/cuda/bin/"$t" 2>/dev/null)
        [ -n "$p" ] && ln -sf "$p" "$tb/triton/backends/nvidia/bin/$t"
    done
    export PYTHONPATH="$tb${PYTHONPATH:+:$PYTHONPATH}" TRITON_CACHE_DIR=/tmp/triton_bundle_cache
fi
