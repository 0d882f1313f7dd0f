#!/bin/sh
# Installs the Debian packages kvrope needs, and only the missing ones, so that
# `make test` and `make run` work on a fresh Debian 12 machine as root.
# Usage: scripts/deps.sh [core|test|bench|fuzz]   (test, bench and fuzz each include
# core and test; fuzz adds clang and its libFuzzer runtime for make fuzz/fuzz-ci)
set -eu
level=${1:-test}
pkgs="build-essential pkg-config libuv1-dev libjemalloc-dev libprotobuf-c-dev protobuf-c-compiler liburing-dev libcjson-dev"
case "$level" in
  test)  pkgs="$pkgs libcriterion-dev python3 python3-numpy python3-pytest python3-torch git nodejs npm" ;;
  bench) pkgs="$pkgs libcriterion-dev python3 python3-numpy python3-pytest python3-torch git nodejs npm redis-server redis-tools" ;;
  fuzz)  pkgs="$pkgs libcriterion-dev python3 python3-numpy python3-pytest python3-torch git nodejs npm clang libclang-rt-14-dev" ;;
  core)  ;;
  *) echo "usage: $0 [core|test|bench|fuzz]" >&2; exit 2 ;;
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
