#!/usr/bin/env bash
# Issue 7 on the 35B shapes: `luce-tune run` under the appliance's 24 GB cap with the experts in
# their Q4_0 blocks on both tiers (budgets in quantized bytes) and graph decoding, on a workload
# cut down so that a trial with every expert on the CPU fits its box (one code and one
# long-form prompt of 128 tokens, 16 new tokens, two repeats); then `luce-tune boot` on the
# published profile. Then issue 4's shadow-state check with the graph verify path, in float32.
# COLD_DEVICE=gpu: the experts outside a budget computed by the GPU from host memory.
source "$(dirname "$0")/env.sh"
capped35_toml /tmp/q35.toml -e "s#^profile = .*#profile = \"$OUT/profile_q35.toml\"#" \
  -e "s#^cold_device = .*#cold_device = \"${COLD_DEVICE:-cpu}\"#"
t0=$(date +%s)
timeout ${STUDY_S:-330} python3 -m tuner.cli run --config /tmp/q35.toml --trials ${TRIALS:-4} --timeout ${RUN_S:-300} \
  --storage "sqlite:///$OUT/study_q35.db" > "$OUT/run_q35.log" 2>&1 || echo "study rc=$?"
echo "study $(( $(date +%s) - t0 )) s"
tail -40 "$OUT/run_q35.log"
python3 -m tuner.cli status --config /tmp/q35.toml --storage "sqlite:///$OUT/study_q35.db" 2>&1 | tail -30 || true
[ -f "$OUT/profile_q35.toml" ] && { timeout ${BOOT_S:-120} python3 -m tuner.cli boot --config /tmp/q35.toml \
  --profile "$OUT/profile_q35.toml" 2>&1 | tail -15 || echo "boot rc=$?"; }
timeout ${CHECK_S:-90} python3 bench/dflash_lossless.py --target models/luce-target.gguf --draft models/luce-draft.gguf \
  --dtype float32 --spec-lens 4,8 --prompts 1 --new-tokens 96 --prompt-tokens 192 --verify-paths graph \
  --corpus engine/dflash/speculative.py 2>&1 | grep -v Warn || echo "check rc=$?"
