#!/usr/bin/env bash
# The DFlash device loop's CUDA tests: the state restore at a device-side keep captured in a graph against the
# host's restore, and greedy identity with the loop's three captured launches (and with the host loop), plain
# stretches included. Short: for the last minutes of a session's device time.
source "$(dirname "$0")/env.sh"
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/dflash/test_device_loop.py "tests/engine/dflash/test_gpu.py::test_graph_verify_matches_plain_on_cuda" \
  "tests/engine/dflash/test_gpu.py::test_graph_plain_stretches_match_plain_on_cuda" > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
