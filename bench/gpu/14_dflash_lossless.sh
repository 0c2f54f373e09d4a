#!/usr/bin/env bash
# Why greedy DFlash departs from plain decoding on the H200 (issue 4): the shadow-state check in
# bf16 and float32 with a draft carried in DRAFT (default: the shipped one), then the DFlash,
# rollback and Gated DeltaNet GPU tests, each file in its own box.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
for dt in bfloat16 float32; do
  timeout ${CHECK_S:-120} python3 bench/dflash_lossless.py --target models/luce-target.gguf --draft ${DRAFT:-models/luce-draft.gguf} \
    --dtype $dt --spec-lens 4,8 --verify-paths eager,graph --prompts 2 --new-tokens 128 \
    --corpus /tmp/corpus/held_out.txt 2>&1 | grep -v Warn || true
done
FILES="tests/engine/dflash/test_gpu.py tests/engine/model/test_gated_deltanet.py tests/engine/kernels/test_gdn_decode.py tests/engine/model/test_decode_graph.py" \
  FILE_S=${FILE_S:-100} bash "$(dirname "$0")/10_tests_per_file.sh"
