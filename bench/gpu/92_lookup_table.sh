#!/usr/bin/env bash
# Issue 4: the committed-text lookup on CUDA. Unpacks the candidate target and its draft where they were
# carried xz-compressed (bench/targets/*.gguf.xz: the tree, .whl and both files uncompressed pass the
# working-tree limit), runs the lookup's CUDA tests (TESTS_S), then issue 4's table with LOOKUPS (default
# 0,3) for the retrained target with its draft and (SHIPPED=1) for the shipped target with its 8192x960
# draft; CONTROL=1 adds the same table with a random draft of the same shape (bench/random_draft.py: the
# lookup's share alone); SPECS, LONG, CODE, BUDGETS, TABLE_S, FALLBACKS as in 31_dflash_table.sh.
source "$(dirname "$0")/env.sh"
for x in bench/targets/*.gguf.xz; do
  [ -f "$x" ] && [ ! -f "${x%.xz}" ] && python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2] + '.part', 'wb'))" \
    "$x" "${x%.xz}" && mv "${x%.xz}.part" "${x%.xz}"
done
sha256sum bench/targets/*.gguf 2>/dev/null | cut -c1-16 || true
[ -f /tmp/corpus/held_out.txt ] || python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" \
  > "$OUT/corpus.log" 2>&1
if [ "${TESTS_S:-120}" -gt 1 ]; then
  t0=$(date +%s)
  timeout ${TESTS_S:-120} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
    tests/engine/dflash/test_gpu.py -k lookup > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
  tests_summary $t0
fi
table() {  # name target draft
  local t0; t0=$(date +%s)
  timeout ${TABLE_S:-200} python3 bench/dflash.py --target "$2" --draft "$3" \
    --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens ${SPECS:-4,8,16} --budgets ${BUDGETS:-all,50%} \
    --rollbacks capture --cold-device gpu --long-form ${LONG:-6} --code ${CODE:-3} --new-tokens 400 \
    --lookups ${LOOKUPS:-0,3} --fallbacks ${FALLBACKS:-0} --json "$OUT/dflash_$1.json" 2>&1 | grep -v Warn > "$OUT/dflash_$1.log" || echo "table $1 rc=$?"
  echo "table $1 $(( $(date +%s) - t0 )) s"; tail -${ROWS:-30} "$OUT/dflash_$1.log"
}
[ -f bench/targets/luce-target-more.gguf ] && table more bench/targets/luce-target-more.gguf \
  ${DRAFT:-bench/targets/luce-draft-more-8192x960.gguf}
if [ "${CONTROL:-0}" = 1 ] && [ -f bench/targets/luce-target-more.gguf ]; then
  python3 bench/random_draft.py ${DRAFT:-bench/targets/luce-draft-more-8192x960.gguf} /tmp/draft-random.gguf
  table random bench/targets/luce-target-more.gguf /tmp/draft-random.gguf
fi
[ "${SHIPPED:-1}" = 1 ] && table shipped models/luce-target.gguf bench/drafts/luce-draft-8192x960.gguf
true
