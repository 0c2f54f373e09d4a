#!/usr/bin/env bash
# Cold experts fetched and warmed a layer ahead (issue 9): with placement "alternate" each cold layer follows an
# all-hot one, at whose start its routing is predicted (HybridExperts.set_cold_prefetch(ahead=True)), so that the bus
# and the threads read it during the hot layer, when they have nothing else to do. Here: the 35B file in the
# background beside the prefetch's CUDA tests; then decode at half cold, 64 tokens, 3 repeats, the rows of run A
# (UNITS_A x SHARES_A x FETCH_A x WARM_A: the placements against each other with nothing ahead and with the
# fetch) and run B (alternate only, SHARES_B x FETCH_B x WARM_B), JSON to $OUT; then the llama-bench build
# started in the background for the side by side on the warm machine (carry .snap).
source "$(dirname "$0")/env.sh"
start_q35
prefetch_tests ${TESTS_S:-150}
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
rows() {  # name, then cold_cpu_share.py's arguments
  local name=$1; shift
  timeout ${ROWS_S:-170} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --new-tokens 64 --repeats 3 \
    --json "$OUT/ahead_$name.json" "$@" 2>&1 | grep -v Warn > "$OUT/ahead_$name.log" || echo "rows $name rc=$?"
  grep -E "share" "$OUT/ahead_$name.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' | cut -c1-250 || true
}
rows a --placement-units ${UNITS_A:-alternate,layer} --shares ${SHARES_A:-0.6} --prefetch ${FETCH_A:-0,2} --warm ${WARM_A:-0,4}
[ -n "${SKIP_B:-}" ] || rows b --placement-units alternate --shares ${SHARES_B:-0.45,0.8} --prefetch ${FETCH_B:-0,2,4} \
  --warm ${WARM_B:-4,8}
echo "rows done after $SECONDS s"
[ -n "${NO_BUILD:-}" ] || [ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
