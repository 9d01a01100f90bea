#!/usr/bin/env bash
# Session 23, call 5: the split path with its flagged rows inside the list kernel as the only form (no
# register-path launch after it): the top-k GPU tests, topk_ab's rows, serve-sim with the indexer. Carry build/pylib.
source "$(dirname "$0")/probe_common.sh"
probe_init session23_probe5
export PYTHONPATH="$PWD/src:$PWD"
echo "== GPU tests (top-k)" | tee -a $L
probe_pytest 150 tests/test_indexer.py -k "topk or split or launcher" | tail -3 | tee -a $L
echo "== topk_ab" | tee -a $L
timeout 80 python3 scripts/topk_ab.py --quick --json $OUT/topk_ab_session23.json 2>&1 | grep -v Warn | tee -a $L
echo "== serve-sim with the indexer" | tee -a $L
timeout 80 python3 -m sparse_mla serve-sim --device cuda --indexer --no-progress --json "$OUT/serve_sim_indexer_session23.json" 2>&1 \
  | grep -v Warn | tail -12 | tee -a $L
