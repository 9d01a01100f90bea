# Sourced by the one-call device probes (scripts/*_probe.sh): `probe_init NAME` makes $OUT (default gpu_out),
# sets L=$OUT/NAME.log, strict pipes, unbuffered Python, and N="-n 8" when build/pylib carries pytest-xdist
# (scripts/gpu_check.sh says how to make it; JOBS=N for another count); `probe_pytest TIMEOUT ARGS...` runs
# pytest on this tree's src.
probe_init() {
  OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
  set -uo pipefail
  export PYTHONUNBUFFERED=1
  L=$OUT/$1.log
  N=""; PYTHONPATH="$PWD/build/pylib" python3 -c "import xdist" 2>/dev/null && N="-n ${JOBS:-8}"
  : > "$L"
}
probe_pytest() {
  local t=$1; shift
  PYTHONPATH="$PWD/build/pylib:$PWD/src:$PWD" timeout "$t" python3 -m pytest -q -p no:cacheprovider $N "$@" -rf 2>&1
}
