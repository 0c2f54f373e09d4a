#!/usr/bin/env bash
# Cold experts computed by the GPU from pinned host memory (cold_device="gpu"): its GPU tests (the
# mapped view, the captured step with cold experts), how fast the GPU reads pinned host memory
# (bench/host_reads.py), the captured 35B step with half the experts cold
# profiled, then the 35B budget sweep with both tiers in
# Q4_0 blocks and graph decoding, the cold tier on the device (COLD_DEVICE=cpu: CPU threads).
source "$(dirname "$0")/env.sh"
FILES="tests/engine/test_hybrid_cold_device.py" FILE_S=${FILE_S:-90} bash "$(dirname "$0")/10_tests_per_file.sh"
timeout ${READS_S:-120} python3 bench/host_reads.py --json "$OUT/host_reads.json" 2>&1 | tail -6 || echo "host_reads rc=$?"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --budget-percent 50 --cold-device ${COLD_DEVICE:-gpu} --steps 8 --rows 25 > "$OUT/profile_half_cold.log" 2>&1 \
  || echo "profile rc=$?"
grep -E "experts|static step|decode step|Self CUDA time total" "$OUT/profile_half_cold.log" | head -8 || true
timeout ${SWEEP_S:-360} python3 bench/budget_sweep.py --model /tmp/q35.gguf --points ${POINTS:-0,50,100} --decode 64 \
  --repeats 3 --weights quantized --cold-format quantized --hot-format quantized --cuda-graph \
  --cold-device ${COLD_DEVICE:-gpu} --json "$OUT/sweep_cold_${COLD_DEVICE:-gpu}.json" 2>&1 \
  | tee "$OUT/sweep_cold_${COLD_DEVICE:-gpu}.log" | grep -v Warn || true
