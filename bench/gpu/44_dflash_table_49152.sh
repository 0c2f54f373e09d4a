#!/usr/bin/env bash
# Issue 4: the table (31_dflash_table.sh's) with a draft kept in bench/drafts/ (DRAFT; by default the one on
# 8,192 distilled rows of 512 + 448 tokens; the script's name is that of its first draft, on 49,152 prompts of
# 64 tokens, since removed), without retraining: the held-out corpus is built if missing, the draft copied to
# /tmp/draft, the step bench (STEP_S, 0 skips it) then the table. TARGET as in 31.
source "$(dirname "$0")/env.sh"
[ -f /tmp/corpus/held_out.txt ] || python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" \
  > "$OUT/corpus.log" 2>&1
mkdir -p /tmp/draft
cp ${DRAFT:-bench/drafts/luce-draft-8192x960.gguf} /tmp/draft/luce-draft.gguf
WAIT_S=0 STEP_S=${STEP_S:-60} bash "$(dirname "$0")/31_dflash_table.sh"
