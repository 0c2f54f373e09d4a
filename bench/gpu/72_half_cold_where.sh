#!/usr/bin/env bash
# Where the half-cold step with the CPU share goes, in one process (`bench/cold_cpu_share.py` with the pool
# built with -DLT_STATS=1): per share (SHARES) and thread count (THREADS) decode tok/s, the threads' own time a
# layer's job, the captured step's kernels in device order (the collect launch's time is the device's wait for
# the threads) and prefill at PREFILL tokens (whether idle threads slow it). The host's CPU topology first.
source "$(dirname "$0")/env.sh"
lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA)" || true
t0=$(date +%s)
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
echo "make-model $(( $(date +%s) - t0 )) s"
LUCE_TUNE_HOST_EXPERTS_CFLAGS="${CFLAGS:--DLT_STATS=1}" timeout ${BENCH_S:-420} python3 bench/cold_cpu_share.py \
  --model /tmp/q35.gguf --shares ${SHARES:-0,0.5,0.8} --threads ${THREADS:-15,12} --new-tokens ${NEW:-64} \
  --repeats 3 --prefill ${PREFILL:-512} ${TIMELINE---timeline} --json "$OUT/half_cold_where.json" 2>&1 \
  | grep -v Warn > "$OUT/half_cold_where.log" || echo "bench rc=$?"
grep -E "^share|captured step|^  _|collect|publish" "$OUT/half_cold_where.log" | head -120 || true
