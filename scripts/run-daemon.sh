#!/bin/sh
# `make run`: starts kvroped with embedded defaults and, when build/kvrope-llama
# has the serve subcommand, the HTTP server (llama-server's API: /infill,
# /v1/completions, /v1/chat/completions) on the project's code model in front
# of it; prints how to use both; Ctrl-C or SIGTERM stops both.
#   scripts/run-daemon.sh build/kvroped [extra kvroped flags...]
# Environment (each has a default; the README's blocks use the same ones):
#   KVROPE_RUN_DIR    socket directory: $XDG_RUNTIME_DIR/kvrope, /run/kvrope as
#                     root, else /tmp/kvrope-$UID (created 0700); the socket is
#                     kvroped.sock in it (the CLI's and Python's default too)
#   KVROPE_DISK_DIR   the disk tier (persistent contexts, `put --persist`):
#                     /var/lib/kvrope as root, else $XDG_DATA_HOME/kvrope
#                     (~/.local/share/kvrope)
#   KVROPE_LISTEN     the server's address (127.0.0.1:8012, llama.vim's default)
#   KVROPE_LLAMA, KVROPE_MODEL  the server and its GGUF (build/kvrope-llama,
#                     build/eval/kvrope-code.gguf next to kvroped)
#   KVROPE_SERVE=0    the daemon only
# The server runs with --persist: its sessions survive a restart of both.
# Memory cap: 4 GiB or a quarter of RAM, whichever is smaller. Invariant: the
# script never leaves a child running after it exits.
set -eu
kvroped=${1:?usage: $0 path/to/kvroped [flags...]}
shift
bindir=$(dirname "$kvroped")
if [ -n "${KVROPE_RUN_DIR:-}" ]; then
  dir=$KVROPE_RUN_DIR
elif [ -n "${XDG_RUNTIME_DIR:-}" ]; then
  dir=$XDG_RUNTIME_DIR/kvrope
elif [ "$(id -u)" = 0 ]; then
  dir=/run/kvrope
else
  dir=/tmp/kvrope-$(id -u)
fi
if [ -n "${KVROPE_DISK_DIR:-}" ]; then
  disk=$KVROPE_DISK_DIR
elif [ "$(id -u)" = 0 ]; then
  disk=/var/lib/kvrope
else
  disk=${XDG_DATA_HOME:-$HOME/.local/share}/kvrope
fi
mkdir -p "$dir" "$disk"
chmod 700 "$dir"
sock=$dir/kvroped.sock
listen=${KVROPE_LISTEN:-127.0.0.1:8012}
llama=${KVROPE_LLAMA:-$bindir/kvrope-llama}
model=${KVROPE_MODEL:-$bindir/eval/kvrope-code.gguf}
ram_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null || echo 0)
cap=$((4 * 1024 * 1024 * 1024))
if [ "${ram_kib:-0}" -gt 0 ]; then
  quarter=$((ram_kib * 1024 / 4))
  [ "$quarter" -lt "$cap" ] && cap=$quarter
fi

dpid=""; spid=""
stop() {
  trap - INT TERM EXIT
  [ -n "$spid" ] && kill -TERM "$spid" 2>/dev/null || true
  [ -n "$dpid" ] && kill -TERM "$dpid" 2>/dev/null || true
  [ -n "$spid" ] && wait "$spid" 2>/dev/null || true
  [ -n "$dpid" ] && wait "$dpid" 2>/dev/null || true
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

"$kvroped" --socket "$sock" --max-memory "$cap" --disk-dir "$disk" "$@" &
dpid=$!
# Ready when the CLI gets an answer (at most ~10 s; a daemon that exits
# early, e.g. on a bad flag, has said why on stderr).
i=0
until "$bindir/kvrope" --socket "$sock" -q ping >/dev/null 2>&1; do
  if ! kill -0 "$dpid" 2>/dev/null; then
    dpid=""; echo "make run: kvroped exited (see above)" >&2; exit 1
  fi
  i=$((i + 1))
  [ $i -gt 100 ] && { echo "make run: kvroped did not answer on $sock" >&2; exit 1; }
  sleep 0.1
done

server=""
if [ "${KVROPE_SERVE:-1}" = 0 ]; then
  why="KVROPE_SERVE=0"
elif [ ! -x "$llama" ]; then
  why="$llama was not built (llama.cpp's libraries could not be fetched from npm)"
elif [ ! -f "$model" ]; then
  why="no model at $model"
elif ! "$llama" serve --help 2>&1 | grep -q -- '--listen'; then
  why="this kvrope-llama has no serve subcommand yet"
else
  "$llama" --model "$model" --socket "$sock" serve --listen "$listen" --persist &
  spid=$!
  server=1
fi

cat >&2 <<MSG
kvroped: socket $sock, disk tier $disk, memory cap $cap bytes
  CLI:          $bindir/kvrope ping        (the socket above is its default;
                elsewhere: --socket PATH or KVROPE_SOCKET=PATH)
  Python:       PYTHONPATH=client/python /usr/bin/python3 -c 'import kvrope; print(kvrope.connect().ping())'
  C:            cc prog.c -Iclient -I. -Lbuild -lkvrope -Wl,-rpath,\$PWD/build
MSG
if [ -n "$server" ]; then
  cat >&2 <<MSG
kvrope serve: http://$listen (model $model)
  curl:         curl -s http://$listen/v1/completions -H 'Content-Type: application/json' \\
                  -d '{"prompt": "def add(a, b):", "max_tokens": 16}'
  llama.vim:    let g:llama_config = { 'endpoint': 'http://$listen/infill' }
  OpenAI:       base URL http://$listen/v1 (any API key)
MSG
else
  echo "kvrope serve: not started: $why (the daemon runs alone)" >&2
fi
echo "Ctrl-C stops $( [ -n "$server" ] && echo both || echo it )." >&2

# Whichever child ends first ends the run (the other is stopped by the trap).
while :; do
  if ! kill -0 "$dpid" 2>/dev/null; then
    wait "$dpid" 2>/dev/null && rc=0 || rc=$?; dpid=""
    echo "make run: kvroped exited ($rc)" >&2; exit "$rc"
  fi
  if [ -n "$spid" ] && ! kill -0 "$spid" 2>/dev/null; then
    wait "$spid" 2>/dev/null && rc=0 || rc=$?; spid=""
    echo "make run: kvrope serve exited ($rc)" >&2; exit "$rc"
  fi
  sleep 0.5
done
