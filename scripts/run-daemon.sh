#!/bin/sh
# Starts kvroped in the foreground with embedded defaults (used by `make run`).
#   scripts/run-daemon.sh build/kvroped [extra kvroped flags...]
# Socket: $XDG_RUNTIME_DIR/kvrope, /run/kvrope as root, else /tmp/kvrope-$UID
# (created 0700). Memory cap: 4 GiB or a quarter of RAM, whichever is smaller.
set -eu
kvroped=${1:?usage: $0 path/to/kvroped [flags...]}
shift
if [ -n "${XDG_RUNTIME_DIR:-}" ]; then
  dir=$XDG_RUNTIME_DIR/kvrope
elif [ "$(id -u)" = 0 ]; then
  dir=/run/kvrope
else
  dir=/tmp/kvrope-$(id -u)
fi
mkdir -p "$dir"
chmod 700 "$dir"
sock=$dir/kvroped.sock
ram_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null || echo 0)
cap=$((4 * 1024 * 1024 * 1024))
if [ "${ram_kib:-0}" -gt 0 ]; then
  quarter=$((ram_kib * 1024 / 4))
  [ "$quarter" -lt "$cap" ] && cap=$quarter
fi
bindir=$(dirname "$kvroped")
cat >&2 <<MSG
kvroped: socket $sock, memory cap $cap bytes (Ctrl-C to stop)
  talk to it:   $bindir/kvrope --socket $sock ping
                $bindir/kvrope --socket $sock stats
  flags:        $kvroped --help
MSG
exec "$kvroped" --socket "$sock" --max-memory "$cap" "$@"
