#!/usr/bin/env bash
# After 68 on the warm machine: waits for the llama-bench build (WAIT_S), then the side by side
# (`18_vs_llamacpp.sh`, PROMPTS and DEPTHS) with LUCE_TUNE_COLD_CPU_SHARE at 68's fastest share (SHARE overrides),
# our hot set by whole layers (PLACEMENT_UNIT; on the H100 layers beat experts at share 0.6: 223-228 against
# 211 tok/s, docs/benchmarks.md twelfth round).
source "$(dirname "$0")/env.sh"
for _ in $(seq ${WAIT_S:-360}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"
best=$(python3 -c "import json; r=json.load(open('${SWEEP_JSON:-/tmp/cold_cpu_share.json}'))['rows']; print(max(r, key=lambda x: x['decode_tok_s']['median'])['share'])" 2>/dev/null || echo 0.6)
export LUCE_TUNE_COLD_CPU_SHARE=${SHARE:-$best}
echo "side by side with LUCE_TUNE_COLD_CPU_SHARE=$LUCE_TUNE_COLD_CPU_SHARE"
cat /tmp/llbuild.out; tail -3 /tmp/llbuild/build.log || true
timeout ${VS_S:-400} python3 bench/vs_llamacpp.py --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench \
  --prompts ${PROMPTS:-512,8192} --gen 64 --depths ${DEPTHS:-0,16384} --repeats 3 --ncmoe 20 --weights quantized \
  --experts quantized --cuda-graph --cold-device gpu --placement-unit ${PLACEMENT_UNIT:-layer} --json "$OUT/vs_llamacpp.json" 2>&1 | tee "$OUT/vs_llamacpp.log" | tail -30
