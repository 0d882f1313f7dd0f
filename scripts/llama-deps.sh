#!/bin/sh
# Brings the pinned llama.cpp release into a cache (default build/llama) when
# it is missing, from the npm registry only:
#   - @node-llama-cpp/linux-x64@3.22.1: the prebuilt CPU libraries
#     (libllama.v0.5.0.so, libggml*.so) under CACHE/npm/node_modules/...;
#   - node-llama-cpp@3.22.1: its tarball carries llama/gitRelease.bundle, a git
#     bundle of the exact llama.cpp tree (release v0.5.0) those libraries were
#     built from; its include/ and ggml/include/ are kept under
#     CACHE/llama.cpp-v0.5.0/ (nothing else of the tree is needed).
# Prints exactly one line on stdout: "ok" when the cache is complete, else the
# reason the llama.cpp parts are skipped. Exit status 0 either way (the build
# decides). Concurrent runs serialise on CACHE/.lock. Invariant: the cache
# directories appear only complete (built in a temporary directory, renamed).
#   scripts/llama-deps.sh [CACHE]           fetch if missing, print ok / reason
#   scripts/llama-deps.sh --libdir [CACHE]  print the library directory (exit 1 if absent)
set -u
PKG_VER=3.22.1
REL=v0.5.0
mode=fetch
[ "${1:-}" = "--libdir" ] && { mode=libdir; shift; }
cache=${1:-build/llama}
bins=$cache/npm/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
hdr=$cache/llama.cpp-$REL

complete() {
  [ -f "$bins/libllama.$REL.so" ] && [ -f "$bins/libggml.$REL.so" ] &&
    [ -f "$bins/libggml-base.so" ] && [ -f "$hdr/include/llama.h" ] &&
    [ -f "$hdr/ggml/include/ggml.h" ]
}

if [ "$mode" = libdir ]; then
  [ -f "$bins/libggml-base.so" ] || exit 1
  cd "$bins" && pwd
  exit 0
fi
complete && { echo ok; exit 0; }

skip() { echo "kvrope: skipping the llama.cpp parts: $*"; exit 0; }
command -v npm >/dev/null 2>&1 || skip "npm not found (scripts/deps.sh installs nodejs/npm)"
command -v git >/dev/null 2>&1 || skip "git not found"
mkdir -p "$cache" || skip "cannot create $cache"
exec 9>"$cache/.lock"
flock 9 2>/dev/null || true
complete && { echo ok; exit 0; }

tmp=$(mktemp -d "$cache/tmp.XXXXXX") || skip "cannot create a temporary directory in $cache"
trap 'rm -rf "$tmp"' EXIT INT TERM
NPM="npm --no-audit --no-fund --no-update-notifier --loglevel=error --fetch-retries=1 --fetch-timeout=30000"
firstline() { grep -v '^[[:space:]]*$' "$1" | grep -i -m1 -E 'err|fail|unable|refused|timed|ENOTFOUND|ECONN' || head -1 "$1"; }

if [ ! -f "$bins/libllama.$REL.so" ]; then
  mkdir -p "$tmp/npm"
  echo '{"name":"kvrope-llama-cache","private":true}' > "$tmp/npm/package.json"
  if ! (cd "$tmp/npm" && timeout 600 $NPM install --no-save --ignore-scripts \
          "@node-llama-cpp/linux-x64@$PKG_VER") >"$tmp/npm.log" 2>&1; then
    skip "npm registry unreachable or refused @node-llama-cpp/linux-x64@$PKG_VER ($(firstline "$tmp/npm.log" | cut -c1-160))"
  fi
  [ -f "$tmp/npm/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/libllama.$REL.so" ] ||
    skip "@node-llama-cpp/linux-x64@$PKG_VER has no libllama.$REL.so"
  rm -rf "$cache/npm" && mv "$tmp/npm" "$cache/npm" || skip "cannot move the libraries into $cache"
fi

if [ ! -f "$hdr/include/llama.h" ] || [ ! -f "$hdr/ggml/include/ggml.h" ]; then
  if ! (cd "$tmp" && timeout 600 $NPM pack "node-llama-cpp@$PKG_VER") >"$tmp/pack.log" 2>&1; then
    skip "npm registry unreachable or refused node-llama-cpp@$PKG_VER ($(firstline "$tmp/pack.log" | cut -c1-160))"
  fi
  tgz=$tmp/node-llama-cpp-$PKG_VER.tgz
  [ -f "$tgz" ] || skip "npm pack gave no node-llama-cpp-$PKG_VER.tgz"
  tar -xzf "$tgz" -C "$tmp" package/llama/gitRelease.bundle package/llama/binariesGithubRelease.json \
    2>"$tmp/tar.log" || skip "node-llama-cpp@$PKG_VER: no llama/gitRelease.bundle in the tarball"
  grep -q "\"$REL\"" "$tmp/package/llama/binariesGithubRelease.json" ||
    skip "node-llama-cpp@$PKG_VER names another llama.cpp release than $REL"
  # The bundle holds one commit (its HEAD) and the release tag when present.
  ref=HEAD
  git bundle list-heads "$tmp/package/llama/gitRelease.bundle" 2>/dev/null | grep -q "refs/tags/$REL\$" && ref=$REL
  git clone -q --no-checkout "$tmp/package/llama/gitRelease.bundle" "$tmp/src" >"$tmp/git.log" 2>&1 ||
    skip "git clone of the llama.cpp bundle failed ($(head -1 "$tmp/git.log"))"
  commit=$(git -C "$tmp/src" rev-parse "$ref^{commit}" 2>/dev/null) || skip "the bundle has no $ref"
  mkdir -p "$tmp/hdr"
  (cd "$tmp/src" && git archive "$commit" include ggml/include) | tar -x -C "$tmp/hdr" ||
    skip "cannot extract include/ and ggml/include/ from the bundle"
  printf 'llama.cpp %s commit %s from node-llama-cpp@%s\n' "$REL" "$commit" "$PKG_VER" > "$tmp/hdr/SOURCE"
  rm -rf "$hdr" && mv "$tmp/hdr" "$hdr" || skip "cannot move the headers into $cache"
fi
complete || skip "the cache in $cache is incomplete"
echo "kvrope: fetched llama.cpp $REL (libraries and headers) from npm into $cache" >&2
echo ok
