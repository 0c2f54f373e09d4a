#!/usr/bin/env bash
# Issue 9's half-cold row with part of the cold experts on CPU threads beside the bus: the native pool's and
# the hybrid share's tests (the CUDA ones: the captured step with publish/collect, a bounded wait), then
# decode from the 35B file at half the experts per share (`bench/cold_cpu_share.py`, SHARES).
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_host_experts.py tests/engine/test_hybrid_cpu_share.py > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker
timeout ${BENCH_S:-300} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0,0.25,0.4,0.5} \
  --new-tokens ${NEW:-128} --repeats 3 --json "$OUT/cold_cpu_share.json" 2>&1 | grep -v Warn | tee "$OUT/cold_cpu_share.log" | tail -8
