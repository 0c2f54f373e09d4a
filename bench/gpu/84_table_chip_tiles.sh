#!/usr/bin/env bash
# Two things in one call. Issue 4: its table at spec_len 4, 8 and 16 and both budgets (the tenth round ran spec_len 4
# and 16 at the all-GPU budget only), with the draft's fused launches' CUDA tests first (`81_token_states.sh`'s stages
# with the GPU tests, the restore, step and host benches left out: DTESTS_S, DFLASH_S). Issue 9: decode of the 35B
# file with every expert hot, the tile table read through its chip (an H100 SXM reads the H200's entries,
# `engine.kernels.quant.tuned.chip_of`) against the same table with its chip removed (the entries read by the H200's
# name only), in alternating processes (PAIRS); on an H200 both read the entries by name.
source "$(dirname "$0")/env.sh"
start_q35
TESTS_S=1 RESTORE_S=1 STEP_S=1 HOST_S=1 DTESTS_S=${DTESTS_S:-90} DFLASH_S=${DFLASH_S:-240} SPECS=${SPECS:-4,8,16} \
  bash "$(dirname "$0")/81_token_states.sh" 2>&1 | grep -v "rc=124" || true
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
cp engine/kernels/quant/tuned.json /tmp/tuned_chip.json
python3 -c "import json; d=json.load(open('/tmp/tuned_chip.json'))
for t in d.get('tables', [d]): t.pop('chip', None)
json.dump(d, open('/tmp/tuned_name.json', 'w'))"
for i in $(seq ${PAIRS:-2}); do
  for t in chip name; do
    cp /tmp/tuned_$t.json engine/kernels/quant/tuned.json
    timeout ${BENCH_S:-100} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized --experts quantized \
      --prompt-lens 512 --decode 64 --graph-only --json "$OUT/tiles_$t$i.json" > "$OUT/tiles_$t$i.log" 2>&1 || echo "bench rc=$?"
    echo "tiles by $t, run $i: $(grep -iE "decode" "$OUT/tiles_$t$i.log" | grep -v Warn | tail -2 | tr '\n' ' ')"
  done
done
cp /tmp/tuned_chip.json engine/kernels/quant/tuned.json
