#!/bin/bash
# Runs every benchmark binary in $KVR_BUILD/bench in turn. Each prints its own
# table of ratios against a baseline measured in the same run (memcpy, Redis,
# ggml); absolute times on shared machines mean little.
set -u
build=${KVR_BUILD:?}
export KVR_GGML_DIR=${KVR_GGML_DIR:-$(scripts/ggml-peer.sh "$build/ggml-peer" 2>/dev/null || true)}
[ -z "$KVR_GGML_DIR" ] && echo "note: @node-llama-cpp/linux-x64 could not be installed; ggml columns will be absent"
rc=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  echo "== $(basename "$b")"
  "$b" || rc=1
done
# Benchmarks that drive servers over HTTP are Python (Debian's interpreter).
for p in tests/bench/bench_*.py; do
  [ -f "$p" ] || continue
  echo "== $(basename "$p" .py)"
  KVR_BUILD="$build" /usr/bin/python3 "$p" || rc=1
done
exit $rc
