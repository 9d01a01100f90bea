#!/usr/bin/env bash
# Session 24: the measurements the open issues' "Done when" ask for, in two device calls (each under 600 s).
#   scripts/session24_check.sh tests   the whole GPU suite (12 xdist workers; carry build/pylib), the eager host
#                                      benchmark, serve-sim without and with the indexer, and serve-sim --indexer
#                                      at 354f784 (before the top-k's direct launches; carry build/old354, made by
#                                      `mkdir -p build/old354 && git archive 354f784 src | tar -x -C build/old354`)
#                                      alternating with HEAD, to tell the machine from the code.
#   scripts/session24_check.sh bench   the decode benchmark (default rows, graph and eager), the small-head rows,
#                                      the prefill and the indexer benchmarks.
# Logs to $OUT/<mode>.log; JSON results packed into $OUT/<mode>_json.tar (the device returns at most 8 files).
source "$(dirname "$0")/probe_common.sh"
mode=${1:?tests or bench}
JOBS=12 probe_init "$mode"
export PYTHONPATH="$PWD/src:$PWD"
J=$OUT/json; mkdir -p "$J"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a $L
step() {  # timeout, label, command...
  local t=$1 label=$2; shift 2
  echo "== $label" | tee -a $L
  local s=$SECONDS
  timeout "$t" "$@" 2>&1 | grep -v -i "warn" | tee -a $L
  echo "   ($label: $((SECONDS - s)) s)" | tee -a $L
}
sim() {  # label, src, extra args
  local label=$1 src=$2; shift 2
  echo "== serve-sim $label" | tee -a $L
  PYTHONPATH="$src:$PWD" timeout 70 python3 -m sparse_mla serve-sim --device cuda --no-progress "$@" \
    --json "$J/serve_sim_$label.json" 2>&1 | grep -E "tokens|step latency|PASS|FAIL|rror" | tee -a $L
}
if [ "$mode" = tests ]; then
  echo "== pytest tests/ $N" | tee -a $L
  s=$SECONDS
  probe_pytest 420 tests/ | tee "$OUT/pytest.log" | tail -30 | tee -a $L
  echo "   (pytest: $((SECONDS - s)) s)" | tee -a $L
  step 60 "host" python3 -m benchmarks.host --quick --json "$J/host.json"
  sim plain "$PWD/src"
  sim indexer_head1 "$PWD/src" --indexer
  [ -d build/old354/src ] && sim indexer_old354 "$PWD/build/old354/src" --indexer
  sim indexer_head2 "$PWD/src" --indexer
else
  step 240 "decode (default rows)" python3 -m benchmarks.decode --quick --json "$J/decode.json"
  step 120 "decode (small heads)" python3 -m benchmarks.decode --quick --set small_heads --json "$J/decode_small_heads.json"
  step 100 "prefill" python3 -m benchmarks.prefill --quick --json "$J/prefill.json"
  step 90 "indexer" python3 -m benchmarks.indexer --quick --json "$J/indexer.json"
fi
tar -cf "$OUT/${mode}_json.tar" -C "$J" . && rm -rf "$J"
