#!/usr/bin/env bash
# Issue 4: the float32 projections of 2-7 rows through `skinny.rows_linear` (many narrow programs over the
# outputs, every row dotted against a weight tile read once) against cuBLAS's split-K GEMM and its reduction.
# bench/few_rows.py times each way inside CUDA graphs at the shipped target's and draft's shapes and ranks the
# kernel's tiles; then 87_few_rows_ab.sh runs the DFlash step and issue 4's table at spec_len 4 with cuBLAS below
# 8 rows (as shipped) and with the kernel from 2 rows at the best-ranked tile (LUCE_TUNE_ROWS_TILE).
source "$(dirname "$0")/env.sh"
[ -f /tmp/corpus/held_out.txt ] || python3 -c \
  "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > "$OUT/corpus.log" 2>&1 &
timeout ${ROWS_S:-200} python3 bench/few_rows.py --json "$OUT/few_rows.json" 2>&1 | grep -v Warn | tee "$OUT/few_rows.log"
wait
tile=$(python3 -c "import json; print(','.join(map(str, json.load(open('$OUT/few_rows.json'))['tiles_ranked'][0][0])))")
echo "tile $tile"
LUCE_TUNE_ROWS_TILE=${TILE:-$tile} TESTS_S=${TESTS_S:-1} PAIRS=${PAIRS:-1} MIN_ROWS=${MIN_ROWS:-8 2} LONG=${LONG:-4} \
  bash "$(dirname "$0")/87_few_rows_ab.sh"
