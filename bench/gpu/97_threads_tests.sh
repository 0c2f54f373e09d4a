#!/usr/bin/env bash
# Issue 9, a short call after the twenty-first round's defaults (the pool's affinity build, the fetch in 8 looping
# programs): the 35B file in the background while the prefetch's captured-step CUDA tests run (the default case
# among them: fetch 1, warm 6, 8 programs), the blocking wait's CUDA test and the pool's tests on the device's CPU;
# then half-cold decode at the round's fastest row per thread count (THREADS, default 15,16), one process per
# setting of the decode loop's wait (WAITS, default "0 1": spinning, then sleeping, LUCE_TUNE_BLOCKING_WAIT).
source "$(dirname "$0")/env.sh"
start_q35
prefetch_tests ${TESTS_S:-90}
timeout ${KTESTS_S:-60} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_host_experts.py -k "any_thread or warm or sum_their or blocking_wait" \
  "tests/engine/test_engine_decode_graph.py::test_cuda_blocking_wait_decodes_the_same_tokens" \
  > "$OUT/tests_pool.log" 2>&1 || echo "pool and wait tests rc=$?"
grep -E "passed|failed" "$OUT/tests_pool.log" | tail -1 || true
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
for wait_ in ${WAITS:-0 1}; do
  LUCE_TUNE_BLOCKING_WAIT=$wait_ timeout ${ROWS_S:-120} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
    --new-tokens 64 --repeats 3 --placement-units alternate --shares 0.45 --prefetch 1 --warm 6 --routes main \
    --threads ${THREADS:-15,16} --json "$OUT/threads_rows_wait$wait_.json" 2>&1 | grep -v Warn \
    > "$OUT/threads_rows_wait$wait_.log" || echo "rows (wait $wait_) rc=$?"
  echo "blocking wait $wait_:"
  grep -E "share" "$OUT/threads_rows_wait$wait_.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' \
    | cut -c1-220 || true
done
echo "done after $SECONDS s"
