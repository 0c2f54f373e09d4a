#!/usr/bin/env bash
# Everything still owed, time-boxed stage by stage to fit one 10-minute call: the GPU tests of
# the engine's paths, the PFlash NIAH table, the 35B-shape budget sweep, a DFlash draft trained
# for the shipped target and its speed-ups. Logs and JSON go to /tmp/r and are packed into
# $OUT/results.tar after every stage, so a stage cut by its time box loses only itself.
source "$(dirname "$0")/env.sh"
R=/tmp/r; mkdir -p $R
pack() { tar -C $R -cf "$OUT/results.tar" . ; }
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)"

timeout ${TESTS_S:-80} python3 -m pytest -m gpu -q --tb=short -rfs -p no:cacheprovider \
  tests/engine/dflash tests/engine/test_hybrid.py tests/engine/test_hybrid_quantized.py tests/engine/pflash \
  tests/engine/model tests/engine/kernels/test_moe.py tests/engine/gguf/test_gguf_gpu.py > $R/gpu_tests.log 2>&1 || true
tail -4 $R/gpu_tests.log; pack

timeout ${PFLASH_S:-140} python3 bench/pflash.py --target models/luce-target.gguf --drafter models/luce-drafter.gguf \
  --contexts 4096,8192,16384 --ratios 0.05,0.1,0.2,0.3 --cases 20 --budgets all,50% --max-new 7 \
  --haystack-file /tmp/corpus/held_out.txt --json $R/pflash.json > $R/pflash.log 2>&1 || true
tail -3 $R/pflash.log; pack

( luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > $R/make35b.log 2>&1 &&
  timeout ${SWEEP_S:-110} python3 bench/budget_sweep.py --model /tmp/q35.gguf --points 0,10,25,50,75,100 \
    --decode 8 --repeats 2 --json $R/sweep35b.json > $R/sweep35b.log 2>&1 ) || true
tail -3 $R/sweep35b.log; pack

timeout ${DRAFT_S:-130} python3 -m tuner.cli train-draft --target models/luce-target.gguf --corpus /tmp/corpus/train.txt \
  --out "$OUT/luce-draft.gguf" --layers 3 --features 3 --block-size 16 --batch 4 --steps ${DRAFT_STEPS:-2000} \
  --time-budget ${DRAFT_MINUTES:-1.4}m --device cuda > $R/train_draft.log 2>&1 || true
rm -rf "$OUT"/luce-draft.gguf.ckpt*; mv "$OUT"/*.acceptance.json $R/ 2>/dev/null || true
tail -3 $R/train_draft.log; pack

[ -f "$OUT/luce-draft.gguf" ] && timeout ${DFLASH_S:-75} python3 bench/dflash.py --target models/luce-target.gguf \
  --draft "$OUT/luce-draft.gguf" --corpus /tmp/corpus/held_out.txt --spec-lens 4,8,16 --budgets all,50% \
  --rollbacks capture --long-form 2 --code 2 --new-tokens 400 --json $R/dflash.json > $R/dflash.log 2>&1 || true
tail -12 $R/dflash.log; pack
