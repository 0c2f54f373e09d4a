#!/usr/bin/env bash
# The side by side on a fresh machine in one call with the half-cold step in five launches a layer
# (`HybridExperts._staged_moe`): the llama-bench build (carry .snap) and the 35B file together, then
# `69_share_side_by_side.sh` with SHARE (default 0.4, 73's fastest), PROMPTS and DEPTHS cut to fit the call.
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
SHARE=${SHARE:-0.4} PROMPTS=${PROMPTS:-512} DEPTHS=${DEPTHS:-0} WAIT_S=${WAIT_S:-420} VS_S=${VS_S:-300} \
  bash "$(dirname "$0")/69_share_side_by_side.sh"
