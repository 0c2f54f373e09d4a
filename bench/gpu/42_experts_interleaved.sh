#!/usr/bin/env bash
# Issue 9, after 41: the experts' gate/up launch with gate's and up's K tiles loaded together
# (``_pair_dots2``) and the small launches' warps from 41 in the table. The expert launches' CUDA tests;
# the experts' tiles swept again (the table copied to $OUT); then the captured 35B step in one process:
# the table's tiles and warps from before against the new ones, and the gated norm apart and inside.
source "$(dirname "$0")/env.sh"
start_q35
cp engine/kernels/quant/tuned.json /tmp/tuned_before.json
expert_tests
SHAPES=experts SWEEP_S=${SWEEP_S:-140} sweep_tiles blocks
[ -z "$maker" ] || wait $maker || echo "make-model failed"
OLD="norm-warps=4+rope-warps=4+delta_rule-warps=4"
timeout ${PROFILE_S:-220} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 64 --no-profile --kernel-variants \
  "${VARIANTS:-$OLD+tiles=/tmp/tuned_before.json,tiles=/tmp/tuned_before.json,$OLD,gdn-norm=inside,gdn-norm=apart,$OLD+tiles=/tmp/tuned_before.json,gdn-norm=inside}" \
  > "$OUT/variants.log" 2>&1 || echo "variants rc=$?"
grep -E "^kernels|decode step|loaded" "$OUT/variants.log" || true
