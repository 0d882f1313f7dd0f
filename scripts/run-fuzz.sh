#!/bin/sh
# Runs each libFuzzer target in $1/fuzz for $FUZZ_SECONDS (default 60) seconds,
# keeping a corpus per target under $1/corpus and reading the committed seeds
# in tests/fuzz/corpus/<target>/ too. Exit status non-zero on a crash (the
# reproducer is left in $1/crashes/).
set -eu
dir=${1:-build/fuzz}
secs=${FUZZ_SECONDS:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dir/crashes"
status=0
for f in "$dir"/fuzz/fuzz_*; do
  [ -x "$f" ] || continue
  name=$(basename "$f")
  mkdir -p "$dir/corpus/$name"
  seeds=""
  [ -d "$root/tests/fuzz/corpus/$name" ] && seeds="$root/tests/fuzz/corpus/$name"
  echo "== $name (${secs}s)"
  # shellcheck disable=SC2086
  if ! "$f" -max_total_time="$secs" -max_len=65536 -print_final_stats=1 -timeout=20 \
       -artifact_prefix="$dir/crashes/$name-" "$dir/corpus/$name" $seeds >"$dir/$name.log" 2>&1; then
    status=1
    tail -40 "$dir/$name.log"
    echo "$name: FAILED (log $dir/$name.log)"
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb|Done " "$dir/$name.log" | tail -3
  fi
done
exit $status
