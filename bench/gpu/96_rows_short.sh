#!/usr/bin/env bash
# Issue 9 in a short call, without llama.cpp: the 35B file with the CUDA tests beside it (the prefetch's captured steps
# per route and programs; the routers' scratch, the looping gather and the pool's affinity build, in a box of their
# own), then half-cold decode (placement alternate, share SHARES) per pool build (the default and LT_AFFINITY=1),
# route of the predicting router (ROUTES) and count warmed (WARM), all in one process: the eighteenth round's row
# (side, 4, default build) beside the new ones on the same host. With .snap carried it starts the llama-bench build
# at its end, for 95_route_fetch.sh on the warm machine.
source "$(dirname "$0")/env.sh"
start_q35
( timeout ${KTESTS_S:-60} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py tests/engine/kernels/test_hybrid_split.py tests/engine/kernels/test_host_experts.py \
  -k "scratch or gather_stacks or affinity or warm or any_thread" > "$OUT/tests_kernels.log" 2>&1 || echo "kernel tests rc=$?" ) &
kt=$!
prefetch_tests ${TESTS_S:-75}
wait $kt || true
grep -E "passed|failed" "$OUT/tests_kernels.log" | tail -1 || true
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
timeout ${ROWS_S:-150} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --new-tokens 64 --repeats 3 \
  --placement-units alternate --shares ${SHARES:-0.6} --prefetch 0 --warm ${WARM:-4,6} --routes ${ROUTES:-side,main} \
  --cflags ";-DLT_AFFINITY=1" --json "$OUT/short_rows.json" 2>&1 | grep -v Warn > "$OUT/short_rows.log" || echo "rows rc=$?"
grep -E "share" "$OUT/short_rows.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' | cut -c1-240 || true
mv "$OUT/tests.log" "$OUT/tests_prefetch.log" 2>/dev/null || true
cp "$OUT/short_rows.json" /tmp/short_rows.json 2>/dev/null || true
# With .snap carried, the llama-bench build starts now and goes on on the warm machine for 95_route_fetch.sh,
# which picks its side by side's row among these rows too.
[ ! -f .snap/llama-src.tar.xz ] || [ -x /tmp/llbuild/cmake/bin/llama-bench ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
echo "done after $SECONDS s"
