# Sourced by every script here, on the GPU machine, from the repository root, with .whl and
# .vocab carried: installs the wheels the machine's image lacks and points the engine at the
# Qwen vocabulary. Output goes to $OUT (the device's result folder) or out/gpu.
set -euo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export LUCE_TUNE_VOCAB=${LUCE_TUNE_VOCAB:-$PWD/.vocab/ggml-vocab-qwen35.gguf}
luce() { python3 -m tuner.cli "$@"; }
# The Q4_0 file of the 35B shapes (made once per machine) and an appliance config for it under the
# appliance's 24 GB cap: experts and projections in their Q4_0 blocks, graph decoding, no draft
# or drafter, and a workload cut down so that a trial with every expert on the CPU fits its box
# (one code and one long-form prompt of 128 tokens, 16 new tokens, two repeats). Extra sed
# expressions may follow. Usage: capped35_toml /tmp/q35.toml [-e 's#...#...#' ...]
capped35_toml() {
  local out=$1; shift
  [ -f /tmp/q35.gguf ] || { local t0; t0=$(date +%s); luce make-model --preset qwen3.6-35b-a3b --quant q4_0 \
    -o /tmp/q35.gguf > "$OUT/make.log" 2>&1; echo "make-model $(( $(date +%s) - t0 )) s"; }
  sed -e 's#^target = .*#target = "/tmp/q35.gguf"#' -e 's#^drafts = .*#drafts = []#' -e 's#^drafter = .*#drafter = ""#' \
    -e 's#^vram_cap_mb = .*#vram_cap_mb = 24576#' -e 's#^weights = .*#weights = "quantized"#' \
    -e 's#^experts = .*#experts = "quantized"#' -e 's#^cuda_graph = .*#cuda_graph = true#' \
    -e 's#^long_prompt_tokens = .*#long_prompt_tokens = 128#' -e 's#^max_new_tokens = .*#max_new_tokens = 16#' \
    -e 's#^repeats = .*#repeats = 2#' -e 's#^trial_timeout_s = .*#trial_timeout_s = 200#' \
    -e 's#^load_timeout_s = .*#load_timeout_s = 200#' -e 's#^niah_cases = .*#niah_cases = 0#' "$@" \
    appliance.toml > "$out"
}
# Starts writing the Q4_0 file of the 35B shapes to /tmp/q35.gguf in the background (under a temporary
# name until it is whole), unless it is there; `wait $maker` before using it.
start_q35() {
  if [ -f /tmp/q35.gguf ]; then maker=; return; fi
  (luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.part.gguf > "$OUT/make.log" 2>&1 \
    && mv /tmp/q35.part.gguf /tmp/q35.gguf) &
  maker=$!
}
# The summary of a pytest run logged to $OUT/tests.log and started at $1 (date +%s): its time, its
# result line, its first failures.
tests_summary() {
  echo "tests $(( $(date +%s) - $1 )) s"; grep -E "passed|failed" "$OUT/tests.log" | tail -1 || true
  grep -E "^(FAILED|ERROR)|^E " "$OUT/tests.log" | head -10 || true
}
# The decode tiles swept at the 35B shapes (grid $1: blocks, rows, both or none; SHAPES, SWEEP_S),
# graph-timed, the fastest per shape written to the table, which is copied to $OUT.
sweep_tiles() {
  timeout ${SWEEP_S:-240} python3 bench/quant_matmul.py --sweep --qtypes Q4_0 --grid "$1" --verbose \
    --sweep-shapes ${SHAPES:-attn_qkv,attn_out,gdn_in,gdn_out,lm_head,experts} \
    --warmup 3 --repeats 20 --write-tuned engine/kernels/quant/tuned.json > "$OUT/tiles_sweep.log" 2>&1 \
    || echo "sweep rc=$?"
  grep -v "^    " "$OUT/tiles_sweep.log" | grep -v Warn | tail -12 || true
  cp engine/kernels/quant/tuned.json "$OUT/tuned.json" || true
}
# The expert launches' CUDA tests at the 35B shapes (the shared expert riding in the routed launches, the
# per-pair down launch against the per-token one bit for bit), in a TESTS_S box; log $OUT/tests_kernels.log.
expert_tests() {
  local t0; t0=$(date +%s)
  timeout ${TESTS_S:-100} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
    "tests/engine/kernels/test_quant_matmul.py::test_cuda_shared_expert_rides_in_the_routed_launches_real_shapes" \
    "tests/engine/kernels/test_quant_matmul.py::test_cuda_quantized_moe_real_shapes" > "$OUT/tests.log" 2>&1 \
    || echo "tests rc=$?"
  tests_summary $t0
  mv "$OUT/tests.log" "$OUT/tests_kernels.log"
}
# The prefill launches' CUDA tests at the 35B shapes (the split-layout GEMV/GEMM and the grouped experts'
# whole-block tiles), in a TESTS_S box; log $OUT/tests_tiles.log.
prefill_tile_tests() {
  local t0; t0=$(date +%s)
  timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
    tests/engine/kernels/test_quant_matmul.py -k "cuda_split_layout_real_shapes or (cuda_quantized_moe_real_shapes and split)" \
    > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
  tests_summary $t0
  mv "$OUT/tests.log" "$OUT/tests_tiles.log"
}
# The captured padded prefill's and the engine's graph GPU tests, in a GRAPH_TESTS_S box; log $OUT/tests.log.
prefill_graph_tests() {
  local t0; t0=$(date +%s)
  timeout ${GRAPH_TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
    tests/engine/model/test_prefill_graph.py tests/engine/test_engine_decode_graph.py > "$OUT/tests.log" 2>&1 \
    || echo "tests rc=$?"
  tests_summary $t0
}
# The cold prefetch's CUDA tests (the captured step with fetches against the all-on-device model, the split serving
# fetched rows, the side stream's router) in a TESTS_S box ($1: its default); log $OUT/tests.log.
prefetch_tests() {
  local t0; t0=$(date +%s)
  timeout ${TESTS_S:-$1} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
    tests/engine/test_hybrid_cpu_share.py -k "fetches or prefetch or predict" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
  tests_summary $t0
}
# The DFlash CUDA tests (the delta rule's per-token states, the device loop, the captured rollbacks, graph verify's
# greedy identity) in a TESTS_S box; log $OUT/tests.log.
dflash_tests() {
  local t0; t0=$(date +%s)
  timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
    tests/engine/kernels/test_gdn_decode.py tests/engine/dflash/test_device_loop.py \
    "tests/engine/model/test_decode_graph.py::test_cuda_graph_rollbacks_replay_their_captured_restore" \
    "tests/engine/dflash/test_gpu.py::test_graph_verify_matches_plain_on_cuda" > "$OUT/tests.log" 2>&1 \
    || echo "tests rc=$?"
  tests_summary $t0
}
# The first drafted slot's hit rates on 12 held-out rows (bench/draft_rows.py) for each draft named that exists,
# ROWS_S each; logs and JSON $OUT/first_slot_<name>.*.
first_slot_rows() {
  local d name
  for d in "$@"; do
    [ -f "$d" ] || continue
    name=$(basename "$d" .gguf)
    timeout ${ROWS_S:-60} python3 bench/draft_rows.py --draft "$d" --corpus /tmp/corpus/held_out.txt --split train \
      --ngram-corpus /tmp/corpus/train.txt --rows 12 --prompt 512 --new 96 --json "$OUT/first_slot_$name.json" \
      > "$OUT/first_slot_$name.log" 2>&1 || echo "draft_rows $name rc=$?"
    grep -A7 "^teacher-forced acceptance over" "$OUT/first_slot_$name.log" | sed "s/^/$name: /" || true
  done
}
