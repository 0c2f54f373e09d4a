#!/usr/bin/env bash
# Issues 4 and 9, one call before 18_vs_llamacpp.sh on the warm machine: starts the llama-bench build and
# the Q4_0 35B file in the background (carry .snap), then the few-row float32 projection
# (engine/kernels/skinny.py): its CUDA tests, a DFlash step's parts with it off and on
# (LUCE_TUNE_SKINNY=0/1, bench/dflash_step.py), issue 4's table with the shipped draft; the captured
# step's tests with the table's word GEMV, and the word GEMV's wider row tiles swept (table to $OUT).
source "$(dirname "$0")/env.sh"
[ -f .snap/llama-src.tar.xz ] && bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
t0=$(date +%s)
timeout ${TESTS_S:-90} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_skinny.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
mv "$OUT/tests.log" "$OUT/tests_skinny.log"
for s in 0 1; do
  echo "LUCE_TUNE_SKINNY=$s"
  LUCE_TUNE_SKINNY=$s timeout ${STEP_S:-90} python3 bench/dflash_step.py --target models/luce-target.gguf \
    --draft models/luce-draft.gguf --corpus /tmp/corpus/held_out.txt --spec-lens 4,8,16 \
    --json "$OUT/dflash_step_skinny$s.json" 2>&1 | grep -v Warn || echo "step bench rc=$?"
done
timeout ${DFLASH_S:-200} python3 bench/dflash.py --target models/luce-target.gguf --draft models/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens 4,8,16 --budgets ${BUDGETS:-all,50%} \
  --rollbacks capture --cold-device gpu --long-form 2 --code 2 --new-tokens 400 --fallbacks ${FALLBACKS:-0} \
  --json "$OUT/dflash_table.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_table.log" | tail -14 || echo "table rc=$?"
t0=$(date +%s)
timeout ${GRAPH_S:-100} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/model/test_decode_graph.py tests/engine/test_engine_decode_graph.py \
  -k "${GRAPH_K:-identical_with_and_without or replays}" > "$OUT/tests.log" 2>&1 || echo "graph tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker || echo "make-model failed"
[ -z "${GRID:-}" ] || { cp engine/kernels/quant/tuned.json /tmp/tuned.before.json; sweep_tiles $GRID; }
tail -2 /tmp/llbuild/build.log 2>/dev/null || true
