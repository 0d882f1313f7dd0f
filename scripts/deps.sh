#!/bin/sh
# Installs the Debian packages kvrope needs, and only the missing ones, so that
# `make run` and `make test` work on a fresh Debian 12 machine as root.
# Usage: scripts/deps.sh [core|run|test|bench|fuzz|eval]
#   core   what the C build links (kvroped, kvrope, libkvrope)
#   run    core + what `make run` needs at run time: Debian's python3 with numpy
#          (scripts/gen-gguf.py writes the served model's GGUF) and node/npm/git
#          (client/llama/llama.mk fetches llama.cpp's libraries for kvrope-llama)
#   test   run + the test-only packages below (what `make test` needs)
#   bench, fuzz, eval: test + clang and its libFuzzer runtime (fuzz), matplotlib
#          for make eval's pictures (eval), cmake (bench: scripts/llama-server.sh
#          makes llama-server's UI stub with it, for bench_serve's peer)
# scripts/deps.sh --list LEVEL prints the level's packages and installs nothing.
set -eu
list=0
if [ "${1:-}" = --list ]; then list=1; shift; fi
level=${1:-test}
pkgs="build-essential pkg-config libuv1-dev libjemalloc-dev libprotobuf-c-dev protobuf-c-compiler liburing-dev libcjson-dev libmicrohttpd-dev libsystemd-dev libhiredis-dev libsodium-dev"
runpkgs="python3 python3-numpy nodejs npm git"
# Tests only: Criterion, the Python suite, and for the operations tests promtool
# (prometheus), systemd-analyze (systemd) and groff (the man pages). OpenBLAS:
# Debian's torch and numpy otherwise run on the reference BLAS, ~12x slower
# (eval/train.py, the numpy Llama of the eval tests). libpython3.11-stdlib is
# the eval model's corpus (eval/corpus.py). torch and Redis (the tests' cluster,
# the benches' baseline) are never needed to run kvrope.
testpkgs="$runpkgs libcriterion-dev python3-pytest prometheus systemd groff-base libopenblas0-pthread libpython3.11-stdlib python3-torch redis-server redis-tools"
case "$level" in
  core)  ;;
  run)   pkgs="$pkgs $runpkgs" ;;
  test)  pkgs="$pkgs $testpkgs" ;;
  bench) pkgs="$pkgs $testpkgs cmake" ;;
  fuzz)  pkgs="$pkgs $testpkgs clang libclang-rt-14-dev" ;;
  eval)  pkgs="$pkgs $testpkgs python3-matplotlib" ;;
  *) echo "usage: $0 [--list] [core|run|test|bench|fuzz|eval]" >&2; exit 2 ;;
esac
if [ $list = 1 ]; then echo $pkgs; exit 0; fi
missing=""
for p in $pkgs; do
  # Node and npm may come from elsewhere than Debian (they do on the CI image);
  # the build (llama.cpp from npm, client/llama/llama.mk) and the benches only
  # need the commands, and Debian's npm would conflict.
  case "$p" in
    nodejs) command -v node >/dev/null 2>&1 && continue ;;
    npm)    command -v npm  >/dev/null 2>&1 && continue ;;
    git)    command -v git  >/dev/null 2>&1 && continue ;;
  esac
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  case "$st" in *"install ok installed"*) ;; *) missing="$missing $p" ;; esac
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "kvrope: missing Debian packages:$missing" >&2
  echo "kvrope: run as root, or: sudo apt-get install$missing" >&2
  exit 1
fi
echo "kvrope: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >&2
