#!/bin/sh
# Installs the Debian packages kvrope needs, and only the missing ones, so that
# `make test` and `make run` work on a fresh Debian 12 machine as root.
# Usage: scripts/deps.sh [core|test|bench|fuzz|eval]   (test, bench, fuzz and eval each
# include core and test; fuzz adds clang and its libFuzzer runtime for make fuzz/fuzz-ci;
# eval adds matplotlib for make eval's pictures)
set -eu
level=${1:-test}
pkgs="build-essential pkg-config libuv1-dev libjemalloc-dev libprotobuf-c-dev protobuf-c-compiler liburing-dev libcjson-dev libmicrohttpd-dev libsystemd-dev libhiredis-dev libsodium-dev"
# Tests: Criterion, the Python suite, and for the operations tests promtool
# (prometheus), systemd-analyze (systemd) and groff (the man pages). OpenBLAS:
# Debian's torch and numpy otherwise run on the reference BLAS, ~12x slower
# (eval/train.py, the numpy Llama of the eval tests). libpython3.11-stdlib is
# the eval model's corpus (eval/corpus.py).
testpkgs="libcriterion-dev python3 python3-numpy python3-pytest prometheus systemd groff-base libopenblas0-pthread libpython3.11-stdlib"
case "$level" in
  test)  pkgs="$pkgs $testpkgs python3-torch git nodejs npm redis-server redis-tools" ;;
  bench) pkgs="$pkgs $testpkgs python3-torch git nodejs npm redis-server redis-tools" ;;
  fuzz)  pkgs="$pkgs $testpkgs python3-torch git nodejs npm clang libclang-rt-14-dev" ;;
  eval)  pkgs="$pkgs $testpkgs python3-torch git nodejs npm redis-server redis-tools python3-matplotlib" ;;
  core)  ;;
  *) echo "usage: $0 [core|test|bench|fuzz|eval]" >&2; exit 2 ;;
esac
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
