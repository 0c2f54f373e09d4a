#!/usr/bin/env bash
# Issue 9, after 39: the gated norm inside the delta rule's launch and the small launches' warps.
# Their GPU tests; the small launches timed per warps count (bench/small_kernels.py); Nsight Compute on
# the large launches (40_ncu_kernels.sh); then the captured 35B step with the gated norm apart and
# inside, and with the warps VARIANTS names (from small_kernels.py's fastest counts), in one process.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_gdn_decode.py tests/engine/model/test_decode_graph.py \
  -k "${TESTS_K:-gated_norm or real_shape or bf16_stays or replays}" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
timeout ${SMALL_S:-150} python3 bench/small_kernels.py --json "$OUT/small_kernels.json" > "$OUT/small_kernels.log" 2>&1 \
  || echo "small kernels rc=$?"
grep -E "fastest" "$OUT/small_kernels.log" || true
NCU_S=${NCU_S:-150} bash "$(dirname "$0")/40_ncu_kernels.sh" || true
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-200} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 64 --no-profile --kernel-variants "gdn-norm=apart,gdn-norm=inside,gdn-norm=apart,gdn-norm=inside${VARIANTS:+,$VARIANTS}" \
  > "$OUT/variants.log" 2>&1 || echo "variants rc=$?"
grep -E "^kernels|decode step|loaded" "$OUT/variants.log" || true
