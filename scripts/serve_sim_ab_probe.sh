#!/usr/bin/env bash
# serve-sim with the indexer read 168.7-170.8 K tokens/s in session 23 against 198.7 K in session 21's one run
# while the top-k alone got faster. This call tells the machine from the code: serve-sim --indexer three times
# each, alternating, at HEAD, at HEAD with SPARSE_MLA_DIRECT_LAUNCH=0, and at 354f784 (session 22's last commit,
# before the top-k's direct launches). Make the old tree first and carry it with build/pylib:
#   mkdir -p build/old354 && git archive 354f784 src | tar -x -C build/old354
source "$(dirname "$0")/probe_common.sh"
probe_init serve_sim_ab
run() {  # label, PYTHONPATH src, extra env
  local label=$1 src=$2; shift 2
  env "$@" PYTHONPATH="$src:$PWD" timeout 90 python3 -m sparse_mla serve-sim --device cuda --indexer --no-progress \
    --json "$OUT/serve_sim_${label}_$i.json" 2>&1 | grep -E "tokens|step latency mean|PASS|FAIL" | sed "s/^/$label $i: /" | tee -a $L
}
for i in 1 2 3; do
  run head "$PWD/src"
  run head_tritonlaunch "$PWD/src" SPARSE_MLA_DIRECT_LAUNCH=0
  run old354 "$PWD/build/old354/src"
done
