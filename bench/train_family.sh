#!/usr/bin/env bash
# Build the shipped model family (luce-target.gguf, luce-drafter.gguf) on the CUDA machine in
# one command: install the carried wheels, build the corpus and the BPE tokenizer, train the
# target then the drafter within MINUTES, measure and export them, and leave in $OUT:
#   luce-target.gguf.part-aa, -ab ...   the target, split under the 16 MiB a returned file may take
#   luce-drafter.gguf, luce-*.report.json, README.md (the model card), train.log
# PRESET=target trains the target alone. Run from the repository root with .whl carried
# (../shared/device/wheels.sh fills it):
#   bash bench/train_family.sh [more luce-tune train options]
# Then, here:  cat $FILES/luce-target.gguf.part-* > models/luce-target.gguf
#              cp $FILES/luce-drafter.gguf $FILES/luce-*.report.json models/
#              python -m engine.train.model_card models/
set -euo pipefail
OUT=${OUT:-out/family}
MINUTES=${MINUTES:-7}   # the whole training command (data, both members, measures, export)
SEED=${SEED:-0}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/luce-family}
mkdir -p "$OUT" "$WORK/models"

if compgen -G ".whl/*.whl" >/dev/null; then
  # a site of its own, so that bench/gpu scripts may run beside it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-train .whl/*.whl
  # fla 0.6 refuses its gated chunk backward on Hopper with Triton < 3.7.1 (wrong results);
  # training then takes transformers' torch path for Gated DeltaNet.
  rm -rf /tmp/site-train/fla /tmp/site-train/fla_core-*
  export PYTHONPATH=/tmp/site-train:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

python3 - <<'PY' 2>&1 | tee "$OUT/train.log"
import importlib.util, torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"cuda {torch.cuda.is_available()} ({torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}), "
      f"fla {'yes' if importlib.util.find_spec('fla') else 'no'}")
PY

python3 -m engine.train.cli train --out-dir "$WORK/models" --preset "${PRESET:-both}" --minutes "$MINUTES" --seed "$SEED" \
  --ckpt-dir "$WORK/ckpt" --device "$DEVICE" "$@" 2>&1 | tee -a "$OUT/train.log"

cp "$WORK/models"/luce-*.report.json "$WORK/models/README.md" "$OUT/"
cp "$WORK/models/luce-drafter.gguf" "$OUT/" 2>/dev/null || true
split -b 15m -a 2 "$WORK/models/luce-target.gguf" "$OUT/luce-target.gguf.part-"
sha256sum "$WORK/models"/luce-*.gguf | tee -a "$OUT/train.log"
ls -l "$OUT"
