#!/usr/bin/env bash
# Measure experiment patches (docs/experiments/*.patch) one at a time on the GPU, in one device call:
# for the unpatched tree and then each patch: apply it, run the GPU tests of the kernels it touches,
# the benchmark rows, and revert it. Logs and JSON go to $OUT (or ./gpu_out); a short line per run.
#
#   scripts/try_patches.sh docs/experiments/gluon_narrow_fp16.patch docs/experiments/gluon_narrow_async_consumer.patch
#
# TESTS (default, when unset: the Hopper kernel's and the small-head tests), BENCH (default when unset: the small-head
# benchmark set, --quick), BENCH_MODULE (default benchmarks.decode; e.g. benchmarks.prefill),
# JOBS (pytest-xdist workers when installed; default 6). SKIP_BASE=1 skips the unpatched run.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
N=""; python3 -c "import xdist" 2>/dev/null && N="-n ${JOBS:-6}"
TESTS=${TESTS-"tests/test_gluon.py tests/test_small_heads.py"}
BENCH=${BENCH-"--set small_heads --quick"}
BENCH_MODULE=${BENCH_MODULE:-benchmarks.decode}
runs=("$@"); [ "${SKIP_BASE:-0}" = 1 ] || runs=(none "$@")
# patch_tree FILE [-R]: git apply where the tree is a git checkout, else patch(1)
patch_tree() {
    if git rev-parse --git-dir > /dev/null 2>&1; then
        git apply ${2:-} "$1"
    else
        patch -p1 --quiet ${2:-} < "$1"
    fi
}
for p in "${runs[@]}"; do
    name=$(basename "$p" .patch)
    if [ "$p" != none ] && ! patch_tree "$p"; then
        echo "$name: does not apply"; continue
    fi
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider $N $TESTS > "$OUT/$name.pytest.log" 2>&1
    echo "$name tests: $(tail -n 1 "$OUT/$name.pytest.log")"
    # shellcheck disable=SC2086
    python3 -m "$BENCH_MODULE" $BENCH --json "$OUT/$name.json" > "$OUT/$name.bench.log" 2>&1
    grep -E "^ +[0-9]+ +[0-9]+ " "$OUT/$name.bench.log" | sed "s/^/$name /"
    [ "$p" = none ] || patch_tree "$p" -R
done
