#!/usr/bin/env bash
# Issue 9, on a fresh machine in one call (carry .snap): the llama-bench build and the 35B file together; the
# split's CUDA tests; then half-cold decode (whole layers) per CPU share with the threads' cold pairs taken in
# pair order (LUCE_TUNE_SPLIT_ORDER=weight, the default) and by expert id (expert: the same experts to the same
# side from token to token, so the threads may re-read blocks still in the host's cache), SHARES_<order>, once the
# build has left the cores; then `69_share_side_by_side.sh` at the fastest order and share (ORDER, SHARE override).
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-60} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/kernels/test_hybrid_split.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
for _ in $(seq ${WAIT_S:-420}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"
SHARES_weight=${SHARES_weight:-0.6,0.7}  # the pair order's fastest so far: 0.6-0.65 (twelfth and thirteenth rounds)
SHARES_expert=${SHARES_expert:-0.5,0.6,0.7,0.8,0.9}
for order in ${ORDERS:-weight expert}; do
  shares=SHARES_$order
  LUCE_TUNE_SPLIT_ORDER=$order timeout ${SWEEP_S:-100} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
    --shares ${!shares} --placement-units layer --new-tokens 64 --repeats 3 \
    --json "$OUT/split_$order.json" 2>&1 | grep -v Warn | tee "$OUT/split_$order.log" | grep "^share" \
    || echo "$order sweep rc=$?"
done
read -r best_order best_share < <(python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
rows = []
for f in Path(sys.argv[1]).glob("split_*.json"):
    for r in json.loads(f.read_text())["rows"]:
        rows.append((r["decode_tok_s"]["median"], f.stem.split("_", 1)[1], r["share"]))
best = max(rows) if rows else (0, "weight", 0.6)
print(best[1], best[2])
PY
)
export LUCE_TUNE_SPLIT_ORDER=${ORDER:-$best_order}
echo "side by side with LUCE_TUNE_SPLIT_ORDER=$LUCE_TUNE_SPLIT_ORDER, share ${SHARE:-$best_share}"
SHARE=${SHARE:-$best_share} PROMPTS=${PROMPTS:-512} DEPTHS=${DEPTHS:-0} WAIT_S=1 VS_S=${VS_S:-200} \
  bash "$(dirname "$0")/69_share_side_by_side.sh"
