#!/usr/bin/env bash
# Issue 9: programmatic dependent launch (engine/kernels/pdl.py: each decode kernel is scheduled while
# the one before it finishes, the GEMV loading its first weight tile meanwhile), the router's logits
# and top-k in one launch, and the shared expert's gate computed once per token. Their GPU tests (the
# router replayed in a graph, the quantized kernels at the 35B shapes, the decode graph against eager
# and float32), the decode tiles swept with K tiles up to 4096 (written to the table, copied to $OUT),
# then the captured 35B step profiled with PDL and without (LUCE_TUNE_PDL=0). With .snap carried, the
# llama-bench build starts first, for 18_vs_llamacpp.sh next on the warm machine.
source "$(dirname "$0")/env.sh"
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh" > "$OUT/llbuild_start.log" 2>&1 \
  || echo "llama-bench build did not start"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py tests/engine/kernels/test_rms_norm.py tests/engine/kernels/test_decode_attention.py \
  tests/engine/kernels/test_quant_matmul.py tests/engine/model/test_decode_graph.py tests/engine/test_engine_decode_graph.py \
  -k "${TESTS_K:-real_shapes or cuda_dispatch or replays or bf16_stays or identical_with_and_without or all_hot}" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
SWEEP_S=${SWEEP_S:-200} sweep_tiles ${GRID:-blocks}
[ -z "$maker" ] || wait $maker || echo "make-model failed"
for pdl in 1 0; do
  LUCE_TUNE_PDL=$pdl timeout ${PROFILE_S:-100} python3 bench/profile_decode.py --model /tmp/q35.gguf \
    --weights quantized --experts quantized --steps 8 --rows 40 > "$OUT/profile_pdl$pdl.log" 2>&1 || echo "profile rc=$?"
  echo "PDL=$pdl"; grep -E "static step|decode step" "$OUT/profile_pdl$pdl.log" | head -3 || true
done
grep -E "_gemv|_moe|_route|_add_rms" "$OUT/profile_pdl1.log" | head -6 | cut -c1-60,100-200 || true
