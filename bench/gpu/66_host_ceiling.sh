#!/usr/bin/env bash
# The host memory's ceiling for the cold experts (`bench/host_ceiling.py`): the bus's copies and the CPU
# threads alone and at once, in torch's pinned pages and in transparent huge pages registered with CUDA,
# and the CPU share's pool beside the copies. No model file: about 2 minutes on a fresh machine.
source "$(dirname "$0")/env.sh"
{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA|MHz|L3" || true; free -g | head -2; } | tee "$OUT/host.txt"
timeout ${CEILING_S:-300} python3 bench/host_ceiling.py --gib ${GIB:-8} --threads ${THREADS:-4,8,16} \
  --pool-threads ${POOL_THREADS:-8,15} --json "$OUT/host_ceiling.json" 2>&1 | grep -v Warn | tee "$OUT/host_ceiling.log"
