#!/usr/bin/env bash
# NIAH accuracy and TTFT with and without PFlash at 4K/8K/16K, at two expert budgets (issue 5).
# The JSON is rewritten after each context length, so a run cut by PFLASH_S keeps what it measured.
source "$(dirname "$0")/env.sh"
[ -f /tmp/corpus/held_out.txt ] || python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)"
timeout ${PFLASH_S:-270} python3 bench/pflash.py --target ${TARGET:-models/luce-target.gguf} --drafter ${DRAFTER:-models/luce-drafter.gguf} \
  --contexts 4096,8192,16384 --ratios 0.05,0.1,0.2,0.3 --cases 20 --budgets ${BUDGETS:-all,50%} \
  --haystack-file /tmp/corpus/held_out.txt --json "$OUT/pflash${TAG:-}.json" 2>&1 | tee "$OUT/pflash${TAG:-}.log" || true
