#!/usr/bin/env bash
# The half-cold step in five launches a layer (`HybridExperts._staged_moe`: split + publish, the bus's experts
# gathered into the stage, one pair of expert launches over slots and stage with the shared expert, collect):
# its CUDA tests, then decode per share in one process with the threads' job time and the captured step's
# timeline (`bench/cold_cpu_share.py`, SHARES, pool built with -DLT_STATS=1), then the launches apart
# (LUCE_TUNE_HYBRID_STAGED=0) at APART shares in another process, for the A/B on one machine.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_hybrid_split.py tests/engine/kernels/test_quant_matmul.py::test_cuda_stage_stack_real_shapes \
  tests/engine/test_hybrid_cpu_share.py tests/engine/test_hybrid_cold_device.py -k "cuda or test_split or gather_stacks" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
wait $maker
LUCE_TUNE_HOST_EXPERTS_CFLAGS=-DLT_STATS=1 timeout ${BENCH_S:-240} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
  --shares ${SHARES:-0,0.4,0.5,0.6,0.7} --new-tokens 64 --repeats 3 --prefill ${PREFILL:-512} ${TIMELINE---timeline} \
  --json "$OUT/staged.json" 2>&1 | grep -v Warn > "$OUT/staged.log" || echo "staged rc=$?"
grep -E "^share|captured step" "$OUT/staged.log" || true
LUCE_TUNE_HYBRID_STAGED=0 timeout ${APART_S:-120} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
  --shares ${APART:-0,0.5} --new-tokens 64 --repeats 3 --json "$OUT/apart.json" 2>&1 | grep -v Warn \
  > "$OUT/apart.log" || echo "apart rc=$?"
grep -E "^share" "$OUT/apart.log" || true
