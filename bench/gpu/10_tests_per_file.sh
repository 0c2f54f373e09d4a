#!/usr/bin/env bash
# Every GPU-marked test file under its own time box (FILE_S seconds, default 100), verbose, so
# that a slow file cannot hide the verdicts of the others and every failure keeps its traceback.
# Prints one line per file, then the failures; the logs go to $OUT/tests.tar.gz.
source "$(dirname "$0")/env.sh"
mkdir -p /tmp/testlogs
# (a collection error elsewhere must not end the script: pytest's status is ignored here)
files=${FILES:-$( (python3 -m pytest -m gpu --co -q -o addopts="" -p no:cacheprovider tests --ignore=tests/dashboard 2>/dev/null || true) \
  | grep '::' | sed 's/::.*//' | sort -u)}
for f in $files; do
  log=/tmp/testlogs/$(echo "$f" | tr '/' '_').log
  rc=0
  timeout ${FILE_S:-100} python3 -m pytest -m gpu -o addopts="" -v --tb=short -p no:cacheprovider "$f" > "$log" 2>&1 || rc=$?
  printf '%-55s rc=%-3s %s passed, %s failed, %s skipped\n' "$f" "$rc" "$(grep -c ' PASSED' "$log")" \
    "$(grep -c ' FAILED' "$log")" "$(grep -c ' SKIPPED' "$log")"
done | tee "$OUT/tests_summary.txt"
grep -h -A12 "^____" /tmp/testlogs/*.log | head -150 || true
tar -czf "$OUT/tests.tar.gz" -C /tmp testlogs
