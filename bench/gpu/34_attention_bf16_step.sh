#!/usr/bin/env bash
# The GPU tests owed since the last changes: the split-key attention at the real shapes (chunk 64
# and 256, and the chunk rule), the bf16 captured step on the shipped target, the DFlash graph
# tests; then a DFlash step's graphs timed (bench/dflash_step.py) with the shipped draft.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_decode_attention.py tests/engine/model/test_decode_graph.py \
  -k "cuda or bf16" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
echo "tests $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -10 || true
timeout ${STEP_S:-150} python3 bench/dflash_step.py --target models/luce-target.gguf --draft models/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --spec-lens ${SPECS:-4,16} --json "$OUT/dflash_step.json" 2>&1 | grep -v Warn \
  || echo "step bench rc=$?"
