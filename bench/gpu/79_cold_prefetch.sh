#!/usr/bin/env bash
# Cold experts fetched ahead of each layer's router by the bus and warmed by the CPU threads, from the predicted
# routing (`HybridExperts.set_cold_prefetch`): the 35B file in the background; the CUDA tests (the captured step
# with fetches against the all-on-device model, the split serving fetched rows, the side stream's router) and
# the CPU share's; the pool's job with its experts warmed first and not (`bench/host_share_pool.py --warm`, 15
# threads: the most a warm-up can give on this host); then decode at half cold per share (SHARES), count fetched
# (FETCH) and count warmed (WARM),
# the rows to /tmp/cold_prefetch.json for 80. The llama-bench build would take the threads' cores: it starts at
# the end, when .snap is carried, for 80 on the warm machine.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/test_hybrid_cpu_share.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
t0=$(date +%s)
timeout ${KTESTS_S:-120} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_hybrid_split.py tests/engine/kernels/test_moe_gate.py -k "split or select or route" \
  > "$OUT/tests_kernels.log" 2>&1 || echo "kernel tests rc=$?"
echo "kernel tests $(( $(date +%s) - t0 )) s"; grep -E "passed|failed" "$OUT/tests_kernels.log" | tail -1 || true
grep -E "^(FAILED|ERROR)|^E " "$OUT/tests_kernels.log" | head -10 || true
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
timeout ${POOL_S:-90} python3 bench/host_share_pool.py --pinned --warm --threads 15 --pairs 1,2,3 --jobs 60 \
  --activations int8 --json "$OUT/pool_warm.json" 2>&1 | grep -v Warn | tee "$OUT/pool_warm.log" || echo "pool rc=$?"
timeout ${BENCH_S:-330} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0.5,0.6} \
  --prefetch ${FETCH:-0,1,2} --warm ${WARM:-0,2} --new-tokens 64 --repeats 3 --json "$OUT/cold_prefetch.json" 2>&1 \
  | grep -v Warn > "$OUT/cold_prefetch.log" || echo "decode rc=$?"
grep -E "share" "$OUT/cold_prefetch.log" || true
cp "$OUT/cold_prefetch.json" /tmp/cold_prefetch.json || true
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
