#!/usr/bin/env bash
# After 79 on the warm machine (the build done): the side by side (`69_share_side_by_side.sh`) at 79's fastest
# row, its share and its count of cold experts fetched ahead (SHARE and FETCH override).
source "$(dirname "$0")/env.sh"
read -r best_share best_fetch < <(python3 -c "
import json; r=max(json.load(open('/tmp/cold_prefetch.json'))['rows'], key=lambda x: x['decode_tok_s']['median'])
print(r['share'], r['cold_prefetch'])" 2>/dev/null || echo "0.6 0")
export LUCE_TUNE_COLD_PREFETCH=${FETCH:-$best_fetch}
echo "cold experts fetched ahead a layer: $LUCE_TUNE_COLD_PREFETCH"
SHARE=${SHARE:-$best_share} PROMPTS=${PROMPTS:-512} DEPTHS=${DEPTHS:-0} WAIT_S=${WAIT_S:-60} VS_S=${VS_S:-400} \
  bash "$(dirname "$0")/69_share_side_by_side.sh"
