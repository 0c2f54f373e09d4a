#!/usr/bin/env bash
# The CPU share's pool in the half-cold step's job sizes (1-3 pairs of one token) per build (chunk sizes, the
# 8-bit loop's prefetch, threads pinned), with host -> device copies running beside the threads as in the step
# (`bench/host_share_pool.py --bus`); then decode at half cold with the builds that the pool ranks first and
# second and the default build (`bench/cold_cpu_share.py --cflags`, SHARES; random tokens fed to the steps as
# llama-bench's, and each row again on the greedy output, whose routing repeats every step), the rows to
# /tmp/cold_variants.json for 77; each placement unit in UNITS (the hot set grown by experts or by whole layers). Starts the llama-bench build at the end when `.snap` is carried (77 waits for it).
source "$(dirname "$0")/env.sh"
start_q35
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
S=-DLT_STATS=1
V=${VARIANTS:-"$S;$S -DLT_CHUNK1=16;$S -DLT_CHUNK1=8;$S -DLT_CHUNK1=16 -DLT_CHUNK2=32;$S -DLT_CHUNK1=8 -DLT_CHUNK2=16;$S -DLT_CHUNK1=16 -DLT_CHUNK2=32 -DLT_PF8=1024;$S -DLT_CHUNK1=16 -DLT_CHUNK2=32 -DLT_PF8=2048;$S -DLT_CHUNK1=16 -DLT_CHUNK2=32 -DLT_PIN=1"}
timeout ${POOL_S:-200} python3 bench/host_share_pool.py --pinned --bus --threads ${THREADS:-15,16} --pairs ${PAIRS:-1,2,3} \
  --jobs ${JOBS:-200} --activations int8 --cflags="$V" --json "$OUT/pool_small.json" 2>&1 | grep -v Warn \
  | tee "$OUT/pool_small.log" || echo "pool rc=$?"
DV=$(python3 - "$OUT/pool_small.json" "$S" <<'PY'
import json, sys
from collections import defaultdict
rows, base = json.load(open(sys.argv[1]))["rows"], sys.argv[2]
total = defaultdict(float)
for r in rows:
    total[r["cflags"]] += r.get("pool_us", r["job_us"])
ranked = sorted(total, key=total.get)
print(";".join(dict.fromkeys([base] + ranked[:2])))
PY
) || DV=$S
echo "decode builds: $DV"
timeout ${BENCH_S:-420} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0,0.45,0.55} \
  --placement-units ${UNITS:-expert,layer} --new-tokens 64 --repeats 3 --also-greedy --cflags="$DV" \
  --json "$OUT/cold_variants.json" 2>&1 | grep -v Warn \
  > "$OUT/cold_variants.log" || echo "decode rc=$?"
grep -E "share" "$OUT/cold_variants.log" || true
cp "$OUT/cold_variants.json" /tmp/cold_variants.json || true
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
