#!/usr/bin/env bash
# After 79 on the warm machine: the llama-bench build (carry .snap), then the side by side
# (`69_share_side_by_side.sh`) at 79's fastest row: its share and its counts fetched and warmed ahead
# (SHARE, FETCH and WARM override).
source "$(dirname "$0")/env.sh"
# the build, unless 79 started it (or it is done)
[ -x /tmp/llbuild/cmake/bin/llama-bench ] || [ -f /tmp/llbuild.out ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
[ -z "$maker" ] || wait $maker
read -r best_share best_fetch best_warm < <(python3 -c "
import json; r=max(json.load(open('/tmp/cold_prefetch.json'))['rows'], key=lambda x: x['decode_tok_s']['median'])
print(r['share'], r['cold_prefetch'], r['cold_warm'])" 2>/dev/null || echo "0.6 0 0")
export LUCE_TUNE_COLD_PREFETCH=${FETCH:-$best_fetch} LUCE_TUNE_COLD_WARM=${WARM:-$best_warm}
echo "ahead a layer: $LUCE_TUNE_COLD_PREFETCH fetched, $LUCE_TUNE_COLD_WARM warmed"
SHARE=${SHARE:-$best_share} PROMPTS=${PROMPTS:-512} DEPTHS=${DEPTHS:-0} WAIT_S=${WAIT_S:-330} VS_S=${VS_S:-240} \
  bash "$(dirname "$0")/69_share_side_by_side.sh"
