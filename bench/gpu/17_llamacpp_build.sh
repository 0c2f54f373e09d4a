#!/usr/bin/env bash
# Starts the CUDA build of llama-bench (sm_90) from .snap/llama-src.tar.xz (bench/gpu/make_llama_src.sh)
# in the background and returns: the build goes on while the machine stays warm, under other
# calls (carry .snap). 18_vs_llamacpp.sh waits for it. Log: /tmp/llbuild/build.log. A second call while one
# is under way leaves it be.
source "$(dirname "$0")/env.sh"
if [ -f /tmp/llbuild.pid ] && kill -0 "$(cat /tmp/llbuild.pid)" 2>/dev/null; then
  echo "llama-bench build already under way (pid $(cat /tmp/llbuild.pid))"; exit 0
fi
mkdir -p /tmp/llama-src
[ -d /tmp/llama-src/llama.cpp ] || tar -xJf .snap/llama-src.tar.xz -C /tmp/llama-src
setsid nohup nice -n 15 python3 - > /tmp/llbuild.out 2>&1 <<'PY' &
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from llamacpp import build_llama_bench, plan_build
plan = plan_build(Path("/tmp/llama-src/llama.cpp"), Path("/tmp/llbuild"), cuda="on", cuda_arch="90")
print(build_llama_bench(plan), flush=True)
PY
echo $! > /tmp/llbuild.pid; echo "llama-bench build started (pid $!)"; sleep 5; cat /tmp/llbuild.out
