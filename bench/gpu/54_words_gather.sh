#!/usr/bin/env bash
# Issue 9, one call on a fresh machine: starts the llama-bench build and the Q4_0 35B file (carry .snap),
# then the experts' word launches (engine/kernels/quant/words.py) and the word GEMV: their CUDA tests, the
# experts' tiles swept with the word candidates (table to $OUT), the captured 35B step profiled with the new
# table; the cold tier's gather (engine/kernels/gather.py): its CUDA tests and the bus rates
# (bench/host_reads.py); the engine's graph tests (plain decoding one step ahead of the host).
# 18_vs_llamacpp.sh (WAIT_S=10) follows on the warm machine.
source "$(dirname "$0")/env.sh"
[ -f .snap/llama-src.tar.xz ] && bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_quant_matmul.py -k word > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
mv "$OUT/tests.log" "$OUT/tests_words.log"
t0=$(date +%s)
timeout ${COLD_TESTS_S:-120} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_gather.py tests/engine/test_hybrid_cold_device.py tests/engine/test_engine_decode_graph.py \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
mv "$OUT/tests.log" "$OUT/tests_cold_graph.log"
cp engine/kernels/quant/tuned.json /tmp/tuned.before.json
SHAPES=${SHAPES:-experts} SWEEP_S=${SWEEP_S:-150} sweep_tiles ${GRID:-words}
timeout ${READS_S:-60} python3 bench/host_reads.py --json "$OUT/host_reads.json" 2>&1 | tail -7 || echo "host_reads rc=$?"
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-110} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 8 --rows 30 --kernel-variants "tiles=/tmp/tuned.before.json,tiles=$PWD/engine/kernels/quant/tuned.json" \
  > "$OUT/profile.log" 2>&1 || echo "profile rc=$?"
grep -E "experts|static step|decode step|tiles=" "$OUT/profile.log" | head -8 || true
grep -E "_gemv|_moe|words" "$OUT/profile.log" | head -8 | cut -c1-60,100-200 || true
tail -2 /tmp/llbuild/build.log 2>/dev/null || true
