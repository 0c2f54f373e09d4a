#!/usr/bin/env bash
# Issue 9: the 35B file written in the background while the decode graph's verify-block and rollback CUDA
# tests run (now on a file of the engine's own writer), then `58_embed_ab_timeline.sh`.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-90} python3 -m pytest -m gpu -p no:cacheprovider tests/engine/model/test_decode_graph.py \
  -k "verify_block or rollbacks_replay" -rA > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary "$t0"
[ -z "$maker" ] || wait $maker
bash "$(dirname "$0")/58_embed_ab_timeline.sh"
