#!/usr/bin/env bash
# Issue 9: a prompt's cold experts in groups (one gather launch per STREAM_EXPERTS scattered cold experts, the
# next group's gather on a second stream, the next cold layer's first group fetched ahead). The 35B file in the
# background while the cold tier's CUDA tests run (TESTS_S), then bench/cold_prefill.py: prefill at half the
# experts cold per setting (runs of consecutive experts as before, groups, groups with the prefetch, captured),
# TOKENS, in a PREFILL_S box; then decode at half cold (SHARES) to check that it did not move (DECODE_S).
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/test_hybrid_cold_device.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
timeout ${PREFILL_S:-240} python3 bench/cold_prefill.py --model /tmp/q35.gguf --tokens ${TOKENS:-512,2048,8192} \
  --repeats 3 --json "$OUT/cold_prefill.json" 2>&1 | grep -v Warn | tee "$OUT/cold_prefill.log" || echo "prefill rc=$?"
[ "${DECODE_S:-100}" = 0 ] || timeout ${DECODE_S:-100} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
  --shares ${SHARES:-0,0.6} --new-tokens 64 --repeats 3 --json "$OUT/cold_decode.json" 2>&1 | grep -v Warn \
  | grep share | cut -c1-220 || echo "decode rc=$?"
