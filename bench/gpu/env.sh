# Sourced by every script here, on the GPU machine, from the repository root, with .whl and
# .vocab carried: installs the wheels the machine's image lacks and points the engine at the
# Qwen vocabulary. Output goes to $OUT (the device's result folder) or out/gpu.
set -euo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export LUCE_TUNE_VOCAB=${LUCE_TUNE_VOCAB:-$PWD/.vocab/ggml-vocab-qwen35.gguf}
luce() { python3 -m tuner.cli "$@"; }
