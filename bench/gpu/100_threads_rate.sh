#!/usr/bin/env bash
# Issue 9, why a warmed job of the CPU share runs slower than a core's cache allows: one call, no model file (carry
# .whl, .vocab, and OLD_SOURCE's folder to compare another pool source). The host's CPUs (lscpu, the cores'
# siblings), then bench/host_dot_rate.c alone (one core through the pool's dot product per matrix) and with
# THREADS_LIST threads at once (each its own regions: computed cold, after a warm-up by loads, after one by
# prefetches), the copier's and the bounded waits' CUDA tests, then the pool alone per build (POOL_CFLAGS, ';'
# between builds) with jobs of POOL_PAIRS pairs, cold and warmed. With OLD_SOURCE (a copy of another version of
# engine/kernels/host_experts.c), its dot rates and its pool rows too, the two sources in turn.
source "$(dirname "$0")/env.sh"
set +e
{ lscpu; echo; lscpu -e; echo; for c in /sys/devices/system/cpu/cpu[0-9]*; do
    echo "$(basename $c) siblings $(cat $c/topology/thread_siblings_list) core $(cat $c/topology/core_id) package $(cat $c/topology/physical_package_id)"; done
  echo; grep -m1 "model name" /proc/cpuinfo; grep MHz /proc/cpuinfo | head -4; } > "$OUT/cpus.log" 2>&1
grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA|L1d|L2|L3|MHz" "$OUT/cpus.log" | head -16
grep siblings "$OUT/cpus.log" | head -3
SRC=engine/kernels/host_experts.c
cc -O3 -march=native -pthread bench/host_dot_rate.c -o /tmp/host_dot_rate -lm || echo "cc rc=$?"
if [ -n "${OLD_SOURCE:-}" ]; then
  sed "s#../engine/kernels/host_experts.c#$PWD/$OLD_SOURCE#" bench/host_dot_rate.c > /tmp/host_dot_rate_old.c
  cc -O3 -march=native -pthread /tmp/host_dot_rate_old.c -o /tmp/host_dot_rate_old -lm || echo "cc old rc=$?"
fi
{ echo "== this source"; /tmp/host_dot_rate
  [ -z "${OLD_SOURCE:-}" ] || { echo "== $OLD_SOURCE"; /tmp/host_dot_rate_old; }
  for t in ${THREADS_LIST:-1 8 15 16}; do /tmp/host_dot_rate threads $t; done
  /tmp/host_dot_rate threads 15 200 512
  /tmp/host_dot_rate threads 15 784 2048
  [ -z "${OLD_SOURCE:-}" ] || { echo "== $OLD_SOURCE"; /tmp/host_dot_rate_old threads 15; /tmp/host_dot_rate_old threads 15 200 512; }
} > "$OUT/dot_rate.log" 2>&1
cat "$OUT/dot_rate.log"
t0=$(date +%s)
timeout ${KTESTS_S:-90} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_host_bus.py tests/engine/kernels/test_host_experts.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
pool() {  # $1: a label
  timeout ${POOL_S:-150} python3 bench/host_share_pool.py --threads 15 --pairs ${POOL_PAIRS:-5,1} --jobs 60 --layers 6 \
    --activations int8 --warm --pinned \
    "--cflags=${POOL_CFLAGS:--DLT_STATS=1 -DLT_WARM_LOAD=1;-DLT_STATS=1 -DLT_WARM_LOAD=1 -DLT_PIN=1;-DLT_STATS=1 -DLT_WARM_LOAD=1 -DLT_CHUNK2=16}" \
    --json "$OUT/pool_$1.json" 2>&1 | grep -v Warn | sed "s#^#$1 #" > "$OUT/pool_$1.log" || echo "pool $1 rc=$?"
  cat "$OUT/pool_$1.log"
}
pool new
if [ -n "${OLD_SOURCE:-}" ]; then
  cp $SRC /tmp/host_experts_new.c && cp "$OLD_SOURCE" $SRC && pool old; cp /tmp/host_experts_new.c $SRC
  [ "${TWICE:-1}" = 0 ] || pool new2
fi
echo "done after $SECONDS s"
