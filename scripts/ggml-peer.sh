#!/bin/sh
# Installs the benchmark peer: ggml's CPU libraries as shipped in the npm
# package @node-llama-cpp/linux-x64 (no headers; the benches declare the few
# ggml functions they call). Prints the directory holding libggml-base.so, or
# nothing (exit 1) if the package cannot be had.
set -u
# The build's llama.cpp cache (client/llama/llama.mk) holds the same package,
# pinned: use it when present rather than a second copy.
if dir=$(scripts/llama-deps.sh --libdir "${LLAMA_CACHE:-build/llama}" 2>/dev/null); then
  echo "$dir"; exit 0
fi
root=${1:-build/ggml-peer}
if ! ls "$root"/node_modules/@node-llama-cpp/linux-x64/bins/*/libggml-base.so >/dev/null 2>&1; then
  command -v npm >/dev/null 2>&1 || exit 1
  mkdir -p "$root"
  (cd "$root" && timeout 600 npm install --no-audit --no-fund --silent @node-llama-cpp/linux-x64@3.22.1 >/dev/null 2>&1) || exit 1
fi
lib=$(ls -d "$root"/node_modules/@node-llama-cpp/linux-x64/bins/*/libggml-base.so 2>/dev/null | head -1)
[ -n "$lib" ] || exit 1
cd "$(dirname "$lib")" && pwd
