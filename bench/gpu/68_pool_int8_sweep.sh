#!/usr/bin/env bash
# The CPU share with chunked scheduling and 8-bit activations: the pool alone per activation width and thread
# count (phases with -DLT_STATS=1), the CPU share's CUDA tests, decode at half the experts cold per share and
# width (`bench/cold_cpu_share.py`), then the llama-bench build started in the background (carry .snap) for
# `69_share_side_by_side.sh` on the warm machine. Nothing else runs beside the measurements.
source "$(dirname "$0")/env.sh"
timeout ${POOL_S:-150} python3 bench/host_share_pool.py --pinned --threads ${THREADS:-8,15} --pairs 4,8 --jobs 100 \
  --cflags="${CFLAGS:--DLT_STATS=1}" --activations float32,int8 2>&1 | grep -v Warn | tee "$OUT/pool_int8.log" || true
t0=$(date +%s)
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
echo "make-model $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/test_hybrid_cpu_share.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
timeout ${BENCH_S:-240} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0,0.5,0.6,0.7,0.8} \
  --activations ${ACTS:-int8} --new-tokens ${NEW:-128} --repeats 3 --json "$OUT/cold_cpu_share.json" 2>&1 \
  | grep -v Warn | tee "$OUT/cold_cpu_share.log" | tail -8
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
cp "$OUT/cold_cpu_share.json" /tmp/cold_cpu_share.json 2>/dev/null || true
