#!/usr/bin/env bash
# Issue 9, after 47: the prefill GEMM of the dense projections reading split-layout Q4_0 tiles as whole
# blocks. Its CUDA tests at the 35B shapes (and the grouped experts'), then prefill at 128-8K tokens per
# dequant_min_m setting (256: the dense matmul on a dequantized copy from 256 rows, as before; 4096; 0:
# the Triton GEMM throughout), with a profile of 512 tokens under the last setting.
source "$(dirname "$0")/env.sh"
start_q35
prefill_tile_tests
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PREFILL_S:-240} python3 bench/profile_prefill.py --model /tmp/q35.gguf --lens ${LENS:-128,512,2048,8192} \
  --dequant-min-m ${SETTINGS:-256,4096,0} --profile-len 512 --rows 30 --json "$OUT/prefill.json" \
  > "$OUT/prefill.log" 2>&1 || echo "prefill rc=$?"
grep -E "^dequant|^prefill|^fit|^profile" "$OUT/prefill.log" || true
