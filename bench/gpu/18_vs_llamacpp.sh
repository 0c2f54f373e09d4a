#!/usr/bin/env bash
# Issue 9's comparison in one run: waits for the llama-bench build of 17_llamacpp_build.sh, then
# bench/vs_llamacpp.py on the real-shape Q4_0 file: prefill 512 and 8K, decode at depth 0 and 16K,
# all on the GPU and with the experts of 20 layers on the CPU (-ncmoe 20), our experts in Q4_0
# blocks on both tiers and decoding from the captured graph; our cold experts computed by the GPU from
# pinned host memory (COLD_DEVICE=cpu: by CPU threads, outside the graph). EAGER_PREFILL=1: our prompts
# prefill eagerly rather than through the captured padded prefill (the default).
source "$(dirname "$0")/env.sh"
for _ in $(seq ${WAIT_S:-240}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
cat /tmp/llbuild.out; tail -3 /tmp/llbuild/build.log || true
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${VS_S:-540} python3 bench/vs_llamacpp.py --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench \
  --prompts 512,8192 --gen 64 --depths 0,16384 --repeats 3 --ncmoe 20 --weights quantized --experts quantized \
  --cuda-graph ${EAGER_PREFILL:+--no-prefill-graph} --cold-device ${COLD_DEVICE:-gpu} --json "$OUT/vs_llamacpp.json" 2>&1 | tee "$OUT/vs_llamacpp.log" | tail -30
