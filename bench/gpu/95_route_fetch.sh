#!/usr/bin/env bash
# Issue 9, the predicting router on the step's stream and the bus's fetch in a few looping programs, in one call on
# a fresh machine (carry .snap): the llama-bench build and the 35B file at once with the CUDA tests beside them (the
# prefetch's captured steps per route and programs, the routers' scratch, the looping gather); once the build is
# done, decode at half cold (placement alternate) per share (SHARES), route (ROUTES) and count warmed (WARM) with
# nothing fetched, then per count fetched (FETCH) and programs (PROGRAMS) at FETCH_WARM warmed on the step's stream
# (share FETCH_SHARE), and per count warmed (AFF_WARM) with the pool built with LT_AFFINITY=1 (each thread computing
# first the chunks it warmed); then `bench/vs_llamacpp.py` on the decode rows (tg64 at depth 0, all-GPU and -ncmoe 20) at the
# fastest row, among 96_rows_short.sh's too where it ran on this machine (ROUTES=none or FETCH=none leaves those
# rows out). ROUTE_CFLAGS (pool builds, ';' between them) adds builds to the route rows' process.
source "$(dirname "$0")/env.sh"
[ -x /tmp/llbuild/cmake/bin/llama-bench ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py tests/engine/kernels/test_hybrid_split.py tests/engine/kernels/test_host_experts.py \
  -k "scratch or gather_stacks or affinity or warm or any_thread" \
  > "$OUT/tests_kernels.log" 2>&1 || echo "kernel tests rc=$?"
grep -E "passed|failed" "$OUT/tests_kernels.log" | tail -1 || true
prefetch_tests ${TESTS_S:-150}
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
for _ in $(seq ${WAIT_S:-300}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"; tail -1 /tmp/llbuild/build.log || true
rows() {  # $1: the JSON's name; the rest: cold_cpu_share.py's row options
  local name=$1; shift
  timeout ${ROWS_S:-200} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --new-tokens 64 --repeats 3 \
    --placement-units alternate "$@" --json "$OUT/$name.json" 2>&1 | grep -v Warn > "$OUT/$name.log" \
    || echo "$name rc=$?"
  grep -E "share" "$OUT/$name.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' | cut -c1-260 || true
}
[ "${ROUTES:-side,main}" = "none" ] || rows route_rows --shares ${SHARES:-0.6,0.7} --prefetch 0 --warm ${WARM:-4,5,6} --routes ${ROUTES:-side,main} \
  ${ROUTE_CFLAGS:+--cflags=$ROUTE_CFLAGS}
[ "${AFF_WARM:-4,6,8}" = "none" ] || rows affinity_rows --cflags=-DLT_AFFINITY=1 --shares ${AFF_SHARES:-0.6} \
  --prefetch 0 --warm ${AFF_WARM:-4,6,8} --routes main
[ "${FETCH:-1,2}" = "none" ] || rows fetch_rows --shares ${FETCH_SHARE:-0.6} --prefetch ${FETCH:-1,2} --warm ${FETCH_WARM:-4} --routes main ${FETCH_CFLAGS:+--cflags=$FETCH_CFLAGS} \
  --fetch-programs ${PROGRAMS:-8,32}
read -r SHARE F W R P C < <(python3 -c "
import glob, json
rows = [r for f in glob.glob('$OUT/*_rows.json') + glob.glob('/tmp/short_rows.json') for r in json.load(open(f))['rows']]
r = max(rows, key=lambda x: x['decode_tok_s']['median'])
print(r['share'], r['cold_prefetch'], r['cold_warm'], r['ahead_route'], r['fetch_programs'], r['cflags'] or '-')" \
  2>/dev/null || echo "0.6 0 4 main 0 -")
[ "$C" != "-" ] || C=
echo "side by side at share $SHARE, fetch $F, warm $W, route $R, programs $P, pool build '$C' after $SECONDS s"
LUCE_TUNE_HOST_EXPERTS_CFLAGS=$C LUCE_TUNE_AHEAD_ROUTE=$R LUCE_TUNE_FETCH_PROGRAMS=$P timeout ${VS_S:-240} python3 bench/vs_llamacpp.py \
  --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench --prompts 0 --gen 64 --depths 0 \
  --repeats ${REPEATS:-3} --ncmoe 20 --weights quantized --experts quantized --cuda-graph --cold-device gpu \
  --cold-cpu-share "$SHARE" --placement-unit alternate --cold-prefetch "$F" --cold-warm "$W" \
  --json "$OUT/vs_llamacpp.json" 2>&1 | grep -v Warn > "$OUT/vs_llamacpp.log" || echo "vs rc=$?"
tail -14 "$OUT/vs_llamacpp.log" || true
echo "done after $SECONDS s"
