#!/usr/bin/env bash
# Issue 9: decode of the 35B shapes from the captured step with the token embedding in host memory and on
# the device (LUCE_TUNE_EMBED_HOST=1/0 in processes of their own, SETTINGS="1 0 1 0" to alternate, `bench/engine_bench.py --graph-only`: the side
# by side of 2026-12-03 read 498.2 tok/s with it in host memory against 510.2 the run before with it on the
# device, on another machine start), then the captured step's device timeline (`bench/profile_decode.py
# --timeline --no-eager`: the routers' pair counters gone from the graph) for each setting.
source "$(dirname "$0")/env.sh"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
for e in ${SETTINGS:-1 0}; do
  LUCE_TUNE_EMBED_HOST=$e timeout ${BENCH_S:-110} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized \
    --experts quantized --prompt-lens 512 --decode 256 --repeats 5 --graph-only > "$OUT/embed_host_$e.log" 2>&1 \
    || echo "bench rc=$?"
  echo "EMBED_HOST=$e: $(grep -E "^(loaded|prefill|decode)" "$OUT/embed_host_$e.log" | tr '\n' ' ')"
done
for e in 1 0; do
  LUCE_TUNE_EMBED_HOST=$e timeout ${PROFILE_S:-120} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized \
    --experts quantized --steps 32 --rows 24 --timeline --no-eager --no-profile > "$OUT/timeline_embed_$e.log" 2>&1 \
    || echo "profile rc=$?"
  head -30 "$OUT/timeline_embed_$e.log" || true
done
