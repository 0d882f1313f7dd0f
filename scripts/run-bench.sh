#!/bin/bash
# Runs every benchmark binary in $KVR_BUILD/bench in turn. Each prints its own
# table of ratios against a baseline measured in the same run (memcpy, Redis,
# ggml); absolute times on shared machines mean little.
set -u
build=${KVR_BUILD:?}
export KVR_GGML_DIR=${KVR_GGML_DIR:-$(scripts/ggml-peer.sh "$build/ggml-peer" 2>/dev/null || true)}
[ -z "$KVR_GGML_DIR" ] && echo "note: @node-llama-cpp/linux-x64 could not be installed; ggml columns will be absent"
# The first-touch cost of fresh anonymous memory, measured just before each
# benchmark and printed beside each of its goal lines: on VMs that report
# free pages to their host it is 10-70x the cost of writing memory already
# touched, and it moves from minute to minute, so a goal line says what
# the machine was doing when it was measured.
touch_rate() {
  /usr/bin/python3 - <<'PY'
import mmap, time
n = 64 << 20
b = b"\x01" * n
m = mmap.mmap(-1, n)
t = time.perf_counter(); m.write(b); fresh = time.perf_counter() - t
m.seek(0)
t = time.perf_counter(); m.write(b); warm = time.perf_counter() - t
print(f"first touch {n / fresh / 1e9:.2f} GB/s, warm {n / warm / 1e9:.2f} GB/s")
PY
}
annotate() {
  local ft=$1
  while IFS= read -r line; do
    case $line in
      goal:*"(not met)") printf '%s [%s] (not met)\n' "${line% (not met)}" "$ft" ;;
      goal:*"(met)") printf '%s [%s] (met)\n' "${line% (met)}" "$ft" ;;
      goal:*) printf '%s [%s]\n' "$line" "$ft" ;;
      *) printf '%s\n' "$line" ;;
    esac
  done
}
rc=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  ft=$(touch_rate)
  echo "== $(basename "$b") ($ft)"
  "$b" | annotate "$ft"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
# Benchmarks that drive servers over HTTP are Python (Debian's interpreter).
for p in tests/bench/bench_*.py; do
  [ -f "$p" ] || continue
  ft=$(touch_rate)
  echo "== $(basename "$p" .py) ($ft)"
  KVR_BUILD="$build" /usr/bin/python3 "$p" | annotate "$ft"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit $rc
