#!/usr/bin/env bash
# Issue 4: the target retrained on more text. The shipped target saw 3.0M tokens of the standard library
# 3.6 times (training loss about 1.1, held-out 3.08 nats/token): it learned its training files more than
# Python. This trains the same shape with the shipped target's tokenizer on the library plus the Python
# sources of the image's packages (PACKAGES, up to EXTRA_MB of text; held-out text stays the library's
# held-out files), for MINUTES in all, through bench/train_family.sh. $OUT gets the target in parts, its
# report and card, and the log. Next: 92_draft_table_target.sh on the warm machine (the target stays in
# /tmp/luce-family/models), or carry the reassembled file as bench/targets/luce-target-more.gguf.
set -euo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
EXTRA=$(python3 - "${PACKAGES:-torch transformers sympy numpy pandas scipy networkx}" <<'PY'
import importlib.util, os, sys
for name in sys.argv[1].split():
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        print(os.path.dirname(spec.origin))
PY
)
args=(--tokenizer-from models/luce-target.gguf --max-extra-mb "${EXTRA_MB:-120}")
for d in $EXTRA; do args+=(--extra-sources "$d"); done
echo "extra sources: $EXTRA"
OUT="$OUT" PRESET=target MINUTES=${MINUTES:-8.5} bash bench/train_family.sh "${args[@]}" ${TRAIN_ARGS:-}
