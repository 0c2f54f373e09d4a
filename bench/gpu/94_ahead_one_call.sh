#!/usr/bin/env bash
# 93's rows and the side by side in one call on a fresh machine (carry .snap): the llama-bench build, the 35B file and
# the prefetch's CUDA tests together; once the build is done and the cores are free, decode at half cold per
# placement (UNITS), share (SHARES), count fetched (FETCH) and warmed (WARM), a cold layer after an all-hot one
# predicted at that layer's start; then `bench/vs_llamacpp.py` on the decode rows only (tg64 at depth 0, all-GPU and
# -ncmoe 20) at the fastest of those rows (or at SHARE, UNIT, F and W where given).
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
prefetch_tests ${TESTS_S:-90}
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
for _ in $(seq ${WAIT_S:-300}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"; tail -2 /tmp/llbuild/build.log || true
if [ -z "${SHARE:-}" ]; then
  timeout ${ROWS_S:-170} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --new-tokens 64 --repeats 3 \
    --placement-units ${UNITS:-alternate,layer} --shares ${SHARES:-0.6} --prefetch ${FETCH:-0,2} --warm ${WARM:-0,4} \
    --json "$OUT/ahead_rows.json" 2>&1 | grep -v Warn > "$OUT/ahead_rows.log" || echo "rows rc=$?"
  grep -E "share" "$OUT/ahead_rows.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' | cut -c1-250 || true
  read -r SHARE UNIT F W < <(python3 -c "import json; r=max(json.load(open('$OUT/ahead_rows.json'))['rows'], key=lambda x: x['decode_tok_s']['median']); print(r['share'], r['placement_unit'], r['cold_prefetch'], r['cold_warm'])" 2>/dev/null || echo "0.6 layer 0 0")
fi
echo "side by side at share $SHARE, unit $UNIT, fetch ${F:-0}, warm ${W:-0} after $SECONDS s"
args=(--cold-cpu-share "$SHARE" --placement-unit "$UNIT")
[ "${F:-0}${W:-0}" = "00" ] || args+=(--cold-prefetch "${F:-0}" --cold-warm "${W:-0}")
timeout ${VS_S:-240} python3 bench/vs_llamacpp.py --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench \
  --prompts 0 --gen 64 --depths 0 --repeats ${REPEATS:-3} --ncmoe 20 --weights quantized --experts quantized --cuda-graph \
  --cold-device gpu "${args[@]}" --json "$OUT/vs_llamacpp.json" 2>&1 | grep -v Warn > "$OUT/vs_llamacpp.log" || echo "vs rc=$?"
tail -14 "$OUT/vs_llamacpp.log" || true
echo "done after $SECONDS s"
