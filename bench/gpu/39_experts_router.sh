#!/usr/bin/env bash
# Issue 9, after 38: the experts' down launch with a program per pair (``gemv_pair_split``) and the
# router's warps. Their CUDA tests (the router's file needs more than 100 s there: TESTS_S); the router's
# settings timed (bench/small_kernels.py --kernels router); the experts' tiles swept with the per-pair down launch in the grid
# (the table copied to $OUT); then the captured 35B step in one process with the router at 4 and 1 warps,
# each with the tile table from before the sweep and after; then the captured-step tests with the new table.
source "$(dirname "$0")/env.sh"
start_q35
cp engine/kernels/quant/tuned.json /tmp/tuned_before.json
t0=$(date +%s)
timeout ${TESTS_S:-100} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py "tests/engine/kernels/test_quant_matmul.py::test_cuda_shared_expert_rides_in_the_routed_launches_real_shapes" \
  "tests/engine/kernels/test_quant_matmul.py::test_cuda_quantized_moe_real_shapes" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
mv "$OUT/tests.log" "$OUT/tests_kernels.log"
timeout ${ROUTER_S:-40} python3 bench/small_kernels.py --kernels router --json "$OUT/router.json" > "$OUT/router.log" 2>&1 \
  || echo "router rc=$?"
grep -E "fastest|table" "$OUT/router.log" || true
SHAPES=experts SWEEP_S=${SWEEP_S:-140} sweep_tiles blocks
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-170} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 64 --no-profile --kernel-variants \
  "router-warps=4+tiles=/tmp/tuned_before.json,router-warps=1+tiles=/tmp/tuned_before.json,router-warps=4,router-warps=1" \
  > "$OUT/variants.log" 2>&1 || echo "variants rc=$?"
grep -E "^kernels|decode step|loaded" "$OUT/variants.log" || true
t0=$(date +%s)
timeout ${GRAPH_S:-60} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/model/test_decode_graph.py tests/engine/test_engine_decode_graph.py \
  -k "${GRAPH_K:-bf16_stays or identical_with_and_without or all_hot}" > "$OUT/tests.log" 2>&1 || echo "graph tests rc=$?"
tests_summary $t0
