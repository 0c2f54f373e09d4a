#!/usr/bin/env bash
# Issue 9, the side by side per build of the CPU share's pool, alternating in one call (carry .whl, .vocab, .snap,
# and OLD_SOURCE's folder: a copy of another version of engine/kernels/host_experts.c). Starts the llama-bench build
# and the 35B file unless they are there, then runs bench/vs_llamacpp.py (half cold as in
# 101_kernel_side_by_side.sh: share SHARE, fetch FETCH, warm WARM, copier COPIER, REPEATS repeats) once per label of
# ORDER, in turn: "new" (this tree's source), "old" (OLD_SOURCE in its place), "loads" (this tree's source built
# with -DLT_WARM_LOAD=1, the default since the thirtieth round), "prefetches" (built with -DLT_WARM_LOAD=0),
# "kernel" (this tree's source, the copy launch as copier), "eager" (this tree's source,
# every CUDA module loaded at start, CUDA_MODULE_LOADING=EAGER: a kernel loaded lazily during a step may need the
# device to be idle, while the step's cold layers spin on the copier). Each run's JSON and log go to
# $OUT/runs.tgz as vs_<n>_<label>.* (one file, so that no run's log is left out of what a call returns); a run starts
# only while RUN_S seconds are left of the call's 590; INTERLEAVE=1 runs each row's repeats in turns (--interleave), INTERLEAVE=ncmoe the half-cold rows only (--interleave ncmoe). A generation running past STALL_TRACE seconds (default 6)
# prints every Python thread's stack into its log (LUCE_TUNE_STALL_TRACE), a stalled pool's or copier's error
# says where its threads stood, and a fatal signal prints the stacks too (-X faulthandler); a run that fails prints the watchdog's report and the stacks after it here.
source "$(dirname "$0")/env.sh"
set +e
SRC=engine/kernels/host_experts.c
cp $SRC /tmp/host_experts_new.c
grep -m1 "model name" /proc/cpuinfo || true
start_q35
[ -x /tmp/llbuild/cmake/bin/llama-bench ] || env -u CFLAGS bash "$(dirname "$0")/17_llamacpp_build.sh" > /dev/null
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
for _ in $(seq ${WAIT_S:-330}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"
RUNS=/tmp/vs_runs; rm -rf $RUNS; mkdir -p $RUNS
interleave=; case ${INTERLEAVE:-0} in 1) interleave=--interleave ;; ncmoe) interleave="--interleave ncmoe" ;; esac
n=0
for label in ${ORDER:-new old new old}; do
  n=$(( n + 1 ))
  left=$(( 590 - SECONDS )); [ $left -ge ${RUN_S:-85} ] || { echo "run $n ($label) not started: $left s left"; break; }
  cflags= copier=${COPIER:-engine} loading=
  case $label in
    new) cp /tmp/host_experts_new.c $SRC ;;
    old) cp "$OLD_SOURCE" $SRC ;;
    loads) cp /tmp/host_experts_new.c $SRC; cflags=-DLT_WARM_LOAD=1 ;;
    prefetches) cp /tmp/host_experts_new.c $SRC; cflags=-DLT_WARM_LOAD=0 ;;
    kernel) cp /tmp/host_experts_new.c $SRC; copier=kernel ;;
    eager) cp /tmp/host_experts_new.c $SRC; loading=CUDA_MODULE_LOADING=EAGER ;;
    *) echo "unknown label $label"; continue ;;
  esac
  t0=$SECONDS
  env $loading LUCE_TUNE_STALL_TRACE=${STALL_TRACE:-6} LUCE_TUNE_HOST_EXPERTS_CFLAGS=$cflags LUCE_TUNE_FETCH_COPIER=$copier LUCE_TUNE_BLOCKING_WAIT=1 \
    timeout $(( left - 5 )) python3 -X faulthandler bench/vs_llamacpp.py \
    --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench --prompts 0 --gen 64 --depths 0 \
    --repeats ${REPEATS:-5} --ncmoe 20 --weights quantized --experts quantized --cuda-graph --cold-device gpu \
    --cold-cpu-share ${SHARE:-0.45} --placement-unit alternate --cold-prefetch ${FETCH:-2} --cold-warm ${WARM:-4} \
    $interleave --json "$RUNS/vs_${n}_$label.json" 2>&1 | grep -v Warn > "$RUNS/vs_${n}_$label.log"
  rc=${PIPESTATUS[0]}
  echo "== run $n ($label) $(( SECONDS - t0 )) s rc=$rc"
  grep -E "^│ *tg" "$RUNS/vs_${n}_$label.log" || tail -3 "$RUNS/vs_${n}_$label.log"
  if [ "$rc" != 0 ]; then
    grep -E -A60 "stood still|Fatal Python" "$RUNS/vs_${n}_$label.log" | grep -v "threading.py" | head -50 || true
  fi
  tar czf "$OUT/runs.tgz" -C $RUNS .
done
cp /tmp/host_experts_new.c $SRC
echo "done after $SECONDS s"
