#!/usr/bin/env bash
# After 64 on the warm machine: waits for the llama-bench build (WAIT_S), the share sweep again with the
# host's cores free (SHARES), then the side by side (`18_vs_llamacpp.sh`) with the sweep's fastest share in
# LUCE_TUNE_COLD_CPU_SHARE (SHARE overrides it).
source "$(dirname "$0")/env.sh"
for _ in $(seq ${WAIT_S:-200}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${POOL_S:-60} python3 bench/host_share_pool.py --pinned --threads ${THREADS:-8,15} --pairs 4 --jobs 100 \
  > "$OUT/host_share_pool.log" 2>&1 || echo "pool rc=$?"
tail -2 "$OUT/host_share_pool.log"
timeout ${BENCH_S:-200} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0,0.4,0.5,0.6,0.7} \
  --new-tokens ${NEW:-128} --repeats 3 --json "$OUT/cold_cpu_share.json" 2>&1 | grep -v Warn | tee "$OUT/cold_cpu_share.log" | tail -6
best=$(python3 -c "import json; r=json.load(open('$OUT/cold_cpu_share.json'))['rows']; print(max(r, key=lambda x: x['decode_tok_s']['median'])['share'])" 2>/dev/null || echo 0.5)
export LUCE_TUNE_COLD_CPU_SHARE=${SHARE:-$best}
echo "side by side with LUCE_TUNE_COLD_CPU_SHARE=$LUCE_TUNE_COLD_CPU_SHARE"
WAIT_S=10 VS_S=${VS_S:-300} bash "$(dirname "$0")/18_vs_llamacpp.sh" | tail -14
