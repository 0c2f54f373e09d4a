#!/usr/bin/env bash
# Issue 9: the residual add + norm before the experts inside the router's launch. The router, the add +
# norm and the fused launch timed alone per warps count (bench/small_kernels.py), its CUDA-graph test, then
# the captured 35B step with the norm apart and inside in alternating pairs (PROFILE_S box).
source "$(dirname "$0")/env.sh"
start_q35
timeout ${SMALL_S:-70} python3 bench/small_kernels.py --kernels router,norm \
  --json "$OUT/small_kernels.json" > "$OUT/small_kernels.log" 2>&1 || echo "small kernels rc=$?"
grep -E "router|norm" "$OUT/small_kernels.log" | grep -v "^ *#" || true
timeout ${TESTS_S:-40} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py -k add_norm_route > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tail -1 "$OUT/tests.log"
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-120} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 64 --no-profile --kernel-variants "norm-route=apart,norm-route=inside,norm-route=apart,norm-route=inside,norm-route=apart,norm-route=inside" \
  > "$OUT/variants.log" 2>&1 || echo "variants rc=$?"
grep -E "^kernels|loaded" "$OUT/variants.log" || true
