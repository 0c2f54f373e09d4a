#!/usr/bin/env bash
# Issue 9: the prefill's expert launches reading split-layout Q4_0 tiles as whole blocks. Starts the
# llama-bench build (17_llamacpp_build.sh, carry .snap) and the Q4_0 35B file in the background; meanwhile
# the grouped launches' CUDA tests, their tiles timed whole-block against per-weight
# (bench/grouped_moe.py), the add + norm inside the router's launch on CUDA; then where a prefill's time
# goes (bench/profile_prefill.py). 18_vs_llamacpp.sh follows on the warm machine.
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  "tests/engine/kernels/test_quant_matmul.py::test_cuda_quantized_moe_real_shapes" > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
mv "$OUT/tests.log" "$OUT/tests_grouped.log"
timeout ${TESTS_S:-120} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py -k add_norm_route > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
timeout ${GROUPED_S:-150} python3 bench/grouped_moe.py --tokens 512,2048,8192 --grid ${GRID:-small} \
  --json "$OUT/grouped_moe.json" > "$OUT/grouped_moe.log" 2>&1 || echo "grouped rc=$?"
grep -E "^fastest|halves=" "$OUT/grouped_moe.log" | cut -c1-150 || true
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PREFILL_S:-150} python3 bench/profile_prefill.py --model /tmp/q35.gguf --lens ${LENS:-128,512,2048,8192} \
  --profile-len 512 --rows 30 --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1 || echo "prefill rc=$?"
grep -E "^prefill|^fit|^profile" "$OUT/prefill.log" || true
tail -2 /tmp/llbuild/build.log 2>/dev/null || true
