#!/usr/bin/env bash
# Issue 9: the residual add + norm inside the router's launch in the captured 35B step (alternating
# pairs, then the step's kernel table), and where a 512-token prefill's time goes (bench/profile_prefill.py:
# wall time at several lengths, the fixed and per-token parts, a profile of 512 tokens).
source "$(dirname "$0")/env.sh"
start_q35
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-200} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 64 --rows 45 --kernel-variants "norm-route=apart,norm-route=inside,norm-route=apart,norm-route=inside,norm-route=apart,norm-route=inside" \
  > "$OUT/variants.log" 2>&1 || echo "variants rc=$?"
grep -E "^kernels|^decode step" "$OUT/variants.log" || true
timeout ${PREFILL_S:-200} python3 bench/profile_prefill.py --model /tmp/q35.gguf --lens ${LENS:-128,512,2048,8192} \
  --profile-len 512 --rows 45 --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1 || echo "prefill rc=$?"
grep -E "^prefill|^fit|^profile" "$OUT/prefill.log" || true
