#!/usr/bin/env bash
# Issue 4: where a DFlash step's wall time goes beyond its graphs' device time. bench/dflash_step.py
# with a torch.profiler trace per spec_len (device time by kernel, host time by op; tables in $OUT),
# then the DFlash and rollback GPU tests.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
t0=$(date +%s)
timeout ${STEP_S:-200} python3 bench/dflash_step.py --target models/luce-target.gguf --draft ${DRAFT:-models/luce-draft.gguf} \
  --corpus /tmp/corpus/held_out.txt --spec-lens ${SPECS:-4,16} --trace ${TRACE:-64} --trace-dir "$OUT" \
  --json "$OUT/dflash_step.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_step.log" || echo "step bench rc=$?"
echo "step bench $(( $(date +%s) - t0 )) s"
for f in "$OUT"/dflash_trace_spec*.txt "$OUT"/plain_trace.txt; do head -1 "$f"; grep -E "cudaGraphLaunch|Self CPU time total|Self CUDA time total" "$f" | head -6 || true; done
t1=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/dflash/test_draft.py tests/engine/dflash/test_gpu.py \
  tests/engine/model/test_decode_graph.py -k "not bf16" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
echo "tests $(( $(date +%s) - t1 )) s"; grep -E "passed|failed|^FAILED|Error" "$OUT/tests.log" | tail -12 || true
