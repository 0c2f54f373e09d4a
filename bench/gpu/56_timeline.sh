#!/usr/bin/env bash
# Issue 9: the token embedding in host memory and the lower-right causal attention of chunked prefill
# (their CUDA tests, first run), then the captured 35B step read as a device timeline
# (bench/profile_decode.py --timeline: every kernel in order, the idle time before each, torch's own
# launches inside the graph) and the torch operators of the static step (--ops). The Q4_0 35B file is
# written beside the tests.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/model/test_weights.py tests/engine/model/test_attention.py > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker
timeout ${PROFILE_S:-200} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized \
  --experts quantized --steps 16 --rows ${ROWS:-60} --timeline --ops --no-profile > "$OUT/timeline.log" 2>&1 \
  || echo "profile rc=$?"
grep -v "^  in order" "$OUT/timeline.log" | head -150 || true
