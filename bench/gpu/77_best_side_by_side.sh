#!/usr/bin/env bash
# After 76 on the warm machine: the side by side (`69_share_side_by_side.sh`, PROMPTS and DEPTHS) at the
# fastest row of 76's decode (its placement unit, share and pool build, LT_STATS left out), unless PLACEMENT_UNIT,
# SHARE and CFLAGS are given.
source "$(dirname "$0")/env.sh"
best=$(python3 -c "import json; r=json.load(open('/tmp/cold_variants.json'))['rows']; b=max(r, key=lambda x: x['decode_tok_s']['median']); print(b.get('placement_unit') or 'expert', b['share'], '|', ' '.join(f for f in (b.get('cflags') or '').split() if f != '-DLT_STATS=1'))" 2>/dev/null || echo "expert 0.5 |")
export LUCE_TUNE_HOST_EXPERTS_CFLAGS=${CFLAGS-${best#*| }}
export PLACEMENT_UNIT=${PLACEMENT_UNIT:-${best%% *}}
best=${best#* }
echo "76's fastest: $best; pool build: '$LUCE_TUNE_HOST_EXPERTS_CFLAGS'; placement unit $PLACEMENT_UNIT"
SHARE=${SHARE:-${best%% |*}} PROMPTS=${PROMPTS:-512} DEPTHS=${DEPTHS:-0} bash "$(dirname "$0")/69_share_side_by_side.sh"
