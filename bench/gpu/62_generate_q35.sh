#!/usr/bin/env bash
# Issue 9's last acceptance line: `luce-tune generate` on the real-shape Q4_0 file, streaming through the
# captured step, every expert on the device and half of them cold (the GPU reading their pinned host
# copies), 400 new tokens each; stdout goes through a reader that stamps each chunk's arrival, so the log
# shows how many pieces came and over how long. While the file is written: the host's copy bandwidth and
# one cold expert matrix on CPU threads (1 and 16), for the half-cold row's bound.
source "$(dirname "$0")/env.sh"
start_q35
timeout ${CPU_S:-60} python3 - > "$OUT/host_copy.log" 2>&1 <<'PY' || echo "host copy rc=$?"
import time, torch
for threads in (1, 8, 16):
    torch.set_num_threads(threads)
    x = torch.ones(512 * 2**20 // 4); y = torch.empty_like(x)
    for _ in range(2): y.copy_(x)
    ts = []
    for _ in range(7):
        t = time.perf_counter(); y.copy_(x); ts.append(time.perf_counter() - t)
    ts.sort()
    print(f"threads {threads}: copy of 512 MiB, median {ts[3]*1e3:.1f} ms, {2 * x.numel() * 4 / ts[3] / 1e9:.1f} GB/s read+write")
PY
cat "$OUT/host_copy.log"
for t in 1 16; do
  timeout ${CPU_S:-60} python3 bench/cpu_cold_tier.py --threads $t --tokens 1 --qtypes q4_0 --warmup 5 --repeats 30 \
    --json "$OUT/cpu_cold_tier_t$t.json" > "$OUT/cpu_cold_tier_t$t.log" 2>&1 || echo "cpu tier t$t rc=$?"
  tail -4 "$OUT/cpu_cold_tier_t$t.log"
done
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
stamp() {  # stdin's chunks: how many, the first and last arrival (s since the reader started), bytes
  python3 -c '
import json, sys, time
t0 = time.perf_counter(); at = []; n = 0
while True:
    b = sys.stdin.buffer.read1(65536)
    if not b: break
    at.append(time.perf_counter() - t0); n += len(b)
print(json.dumps({"chunks": len(at), "first_s": round(at[0], 3) if at else None,
                  "last_s": round(at[-1], 3) if at else None, "bytes": n}))'
}
gen() {  # name, extra options
  local name=$1; shift
  local t0; t0=$(date +%s)
  timeout ${GENERATE_S:-150} python3 -m tuner.cli generate --model /tmp/q35.gguf --prompt "def fibonacci(n):" \
    -n ${NEW:-400} --weights quantized --cold-format quantized --hot-format quantized --cuda-graph "$@" \
    2> "$OUT/generate_$name.err" | stamp > "$OUT/generate_$name.stamps" || echo "generate $name rc=$?"
  echo "generate $name: $(( $(date +%s) - t0 )) s; stdout $(cat "$OUT/generate_$name.stamps")"
  grep -v Warn "$OUT/generate_$name.err" | tail -4 | cut -c1-400
}
gen all --expert-budget 30000
gen half --expert-budget ${HALF_MB:-8640} --cold-device gpu
