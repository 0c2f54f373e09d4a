#!/usr/bin/env bash
# Issue 9, a short call after the twenty-first round's defaults (the pool's affinity build, the fetch in 8 looping
# programs): the 35B file in the background while the prefetch's captured-step CUDA tests run (the default case
# among them: fetch 1, warm 6, 8 programs) and the pool's tests on the device's CPU; then half-cold decode at the
# round's fastest row per thread count (THREADS, default 15,16), one process.
source "$(dirname "$0")/env.sh"
start_q35
prefetch_tests ${TESTS_S:-90}
timeout ${KTESTS_S:-40} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_host_experts.py -k "any_thread or warm or sum_their" > "$OUT/tests_pool.log" 2>&1 \
  || echo "pool tests rc=$?"
grep -E "passed|failed" "$OUT/tests_pool.log" | tail -1 || true
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
timeout ${ROWS_S:-120} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --new-tokens 64 --repeats 3 \
  --placement-units alternate --shares 0.45 --prefetch 1 --warm 6 --routes main --threads ${THREADS:-15,16} \
  --json "$OUT/threads_rows.json" 2>&1 | grep -v Warn > "$OUT/threads_rows.log" || echo "rows rc=$?"
grep -E "share" "$OUT/threads_rows.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' | cut -c1-220 || true
echo "done after $SECONDS s"
