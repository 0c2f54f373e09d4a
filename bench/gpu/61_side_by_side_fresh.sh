#!/usr/bin/env bash
# Issue 9's side-by-side on a fresh machine in one call (carry .snap): the llama-bench build and the 35B file
# side by side, then `18_vs_llamacpp.sh` once both are there (WAIT_S for the build, VS_S for the comparison).
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
WAIT_S=${WAIT_S:-420} VS_S=${VS_S:-330} bash "$(dirname "$0")/18_vs_llamacpp.sh"
