#!/usr/bin/env bash
# Issue 4 after the per-step host work moved into captured graphs: the rollback's state restore
# (one graph per kept length, captured at its first use) and the draft cache's extension (one
# graph per verify step). First their GPU tests (the captured restore against eager forwards
# over the kept tokens, block after block), then issue 4's table as in 24_dflash_table.sh with the
# cold experts read by the GPU, then the other decode-graph and DFlash GPU tests in what is left.
source "$(dirname "$0")/env.sh"
t0=$(date +%s)
timeout ${FIRST_S:-60} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/model/test_decode_graph.py -k "rollbacks_replay or verify_block" > "$OUT/tests_rollback.log" 2>&1 \
  || echo "rollback tests rc=$?"
echo "rollback tests $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/tests_rollback.log" | cut -c1-300 || true
COLD_DEVICE=${COLD_DEVICE:-gpu} DFLASH_S=${DFLASH_S:-200} bash "$(dirname "$0")/24_dflash_table.sh" | tail -14 || true
t1=$(date +%s)
timeout ${TESTS_S:-60} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/dflash/test_gpu.py tests/engine/model/test_decode_graph.py > "$OUT/tests_gpu.log" 2>&1 \
  || echo "gpu tests rc=$?"
echo "gpu tests $(( $(date +%s) - t1 )) s"; grep -E "passed|failed|^FAILED" "$OUT/tests_gpu.log" | tail -8 || true
