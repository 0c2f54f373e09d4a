#!/usr/bin/env bash
# Issue 9's -ncmoe 20 row: the cold tier's decode path that gathers the routed cold experts into a device
# buffer before the expert launches (engine/kernels/gather.py) rather than reading them in place. Starts the
# llama-bench build and the 35B file (carry .snap), then the gather's and the cold tier's CUDA tests, the
# bus rates (bench/host_reads.py: in place, gathered, on the device), the captured 35B step with half the
# experts cold with the gather off and on (LUCE_TUNE_COLD_GATHER=0/1). 18_vs_llamacpp.sh follows.
source "$(dirname "$0")/env.sh"
[ -f .snap/llama-src.tar.xz ] && bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_gather.py tests/engine/test_hybrid_cold_device.py > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
timeout ${READS_S:-120} python3 bench/host_reads.py --json "$OUT/host_reads.json" 2>&1 | tail -7 || echo "host_reads rc=$?"
[ -z "$maker" ] || wait $maker || echo "make-model failed"
for g in 0 1; do
  echo "LUCE_TUNE_COLD_GATHER=$g"
  LUCE_TUNE_COLD_GATHER=$g timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf \
    --weights quantized --experts quantized --budget-percent 50 --cold-device gpu --steps 8 --rows 25 \
    > "$OUT/profile_half_cold_gather$g.log" 2>&1 || echo "profile rc=$?"
  grep -E "experts|static step|decode step" "$OUT/profile_half_cold_gather$g.log" | head -5 || true
done
tail -2 /tmp/llbuild/build.log 2>/dev/null || true
