#!/usr/bin/env bash
# Issue 9, after 42: starts the llama-bench build (17_llamacpp_build.sh, carry .snap) and the Q4_0 35B file
# in the background, and meanwhile runs the expert launches' CUDA tests (the down launch's per-pair sum
# against the per-token one, bit for bit, now with explicit fused multiply-adds in both) and the
# captured-step tests with the warps table of 41. 18_vs_llamacpp.sh follows on the warm machine.
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
expert_tests
t0=$(date +%s)
timeout ${GRAPH_S:-120} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/model/test_decode_graph.py tests/engine/test_engine_decode_graph.py \
  -k "${GRAPH_K:-bf16_stays or identical_with_and_without or all_hot or replays}" > "$OUT/tests.log" 2>&1 \
  || echo "graph tests rc=$?"
tests_summary $t0
tail -3 /tmp/llbuild/build.log 2>/dev/null || true
