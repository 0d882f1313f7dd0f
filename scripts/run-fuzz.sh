#!/bin/sh
# Runs each libFuzzer target in $1/fuzz for $FUZZ_SECONDS (default 60) seconds,
# keeping a corpus per target under $1/corpus. Exit status non-zero on a crash.
set -eu
dir=${1:-build/fuzz}
secs=${FUZZ_SECONDS:-60}
for f in "$dir"/fuzz/fuzz_*; do
  [ -x "$f" ] || continue
  name=$(basename "$f")
  mkdir -p "$dir/corpus/$name"
  echo "== $name (${secs}s)"
  "$f" -max_total_time="$secs" -max_len=65536 -print_final_stats=1 "$dir/corpus/$name" 2>&1 | tail -12
done
