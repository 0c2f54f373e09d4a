#!/usr/bin/env bash
# The side by side on a fresh machine in one call: the llama-bench build (carry .snap) and the 35B file together,
# then, unless SHARE is given, our half-cold decode per CPU share (`bench/cold_cpu_share.py`, SHARES, placement
# PLACEMENT_UNIT) once the build has left the cores, and `69_share_side_by_side.sh` at the fastest share (or at
# SHARE) with PROMPTS and DEPTHS cut to fit the call. The fastest share depends on the host: 0.6-0.65 on the
# twelfth round's H100 and the H200, 0.7-0.8 on a host whose bus copies at 43 GB/s (thirteenth round).
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
if [ -z "${SHARE:-}" ]; then
  for _ in $(seq ${WAIT_S:-420}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
  timeout ${SWEEP_S:-150} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0.5,0.6,0.7,0.8} \
    --placement-units ${PLACEMENT_UNIT:-layer} --new-tokens 64 --repeats 3 --json /tmp/cold_cpu_share.json 2>&1 \
    | grep -v Warn | tee "$OUT/cold_cpu_share.log" | grep "^share" || echo "sweep rc=$?"
  cp /tmp/cold_cpu_share.json "$OUT/" 2>/dev/null || true
fi
SHARE=${SHARE:-} PROMPTS=${PROMPTS:-512} DEPTHS=${DEPTHS:-0} WAIT_S=${WAIT_S:-420} VS_S=${VS_S:-300} \
  bash "$(dirname "$0")/69_share_side_by_side.sh"
