#!/bin/sh
# Builds llama.cpp's llama-server, the peer of kvrope serve's benchmark, from
# the very tree the npm libraries were built from (node-llama-cpp@3.22.1's
# llama/gitRelease.bundle, release v0.5.0), and links it against those
# prebuilt libraries (libllama, libggml*, libllama-common from
# @node-llama-cpp/linux-x64@3.22.1, see scripts/llama-deps.sh): only
# tools/server, tools/mtmd (the server links it even for text models),
# vendor/hash and the UI stub are compiled, so it runs exactly the ggml code
# kvrope links. No web UI (GET / answers 404); no OpenSSL.
#   scripts/llama-server.sh [CACHE [LLAMA_CACHE]]
# CACHE defaults to build/llama-server, LLAMA_CACHE to build/llama. Prints the
# path of the binary on success (exit 0), else the reason on stderr (exit 1).
# The binary appears only complete (linked to a temporary name, renamed).
set -eu
PKG_VER=3.22.1
cache=${1:-build/llama-server}
llama=${2:-build/llama}
bin=$cache/llama-server
[ -x "$bin" ] && ls "$cache"/libggml-cpu-*.so >/dev/null 2>&1 && { echo "$bin"; exit 0; }
fail() { echo "llama-server.sh: $*" >&2; exit 1; }
libdir=$(scripts/llama-deps.sh --libdir "$llama") || fail "no llama.cpp libraries in $llama (make fetches them)"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9 2>/dev/null || true
src=$cache/src
if [ ! -f "$src/tools/server/server.cpp" ]; then
  tmp=$(mktemp -d "$cache/tmp.XXXXXX")
  (cd "$tmp" && timeout 600 npm pack --loglevel=error --no-update-notifier "node-llama-cpp@$PKG_VER" >/dev/null) ||
    fail "npm pack node-llama-cpp@$PKG_VER failed"
  tar -xzf "$tmp/node-llama-cpp-$PKG_VER.tgz" -C "$tmp" package/llama/gitRelease.bundle ||
    fail "no llama/gitRelease.bundle in node-llama-cpp@$PKG_VER"
  git -c advice.detachedHead=false clone -q "$tmp/package/llama/gitRelease.bundle" "$tmp/src" ||
    fail "git clone of the bundle failed"
  rm -rf "$src" && mv "$tmp/src" "$src" && rm -rf "$tmp"
fi
obj=$cache/obj
mkdir -p "$obj/ui"
[ -f "$obj/ui/ui.cpp" ] ||
  cmake -DUI_SOURCE_DIR="$src/tools/ui" -DUI_BINARY_DIR="$obj/ui" -DLLAMA_SOURCE_DIR="$src" \
        -DHF_ENABLED=OFF -DBUILD_UI=OFF -DLLAMA_UI_GZIP=OFF -DHF_BUCKET= -DHF_VERSION= \
        -P "$src/scripts/ui-assets.cmake" >"$obj/ui.log" 2>&1 || fail "UI stub: see $obj/ui.log"
inc="-I$src/include -I$src/ggml/include -I$src/common -I$src/tools/mtmd -I$src/tools/server
     -I$src/vendor -I$src/vendor/hash -I$obj/ui -I$src"
# One compile per line (sources relative to $src), two at a time.
list=$obj/sources
: >"$list"
for f in "$src"/tools/server/*.cpp; do
  case "$f" in */main.cpp) ;; *) echo "${f#$src/}" >>"$list" ;; esac
done
echo tools/server/main.cpp >>"$list"
for f in mtmd.cpp mtmd-audio.cpp mtmd-image.cpp mtmd-helper.cpp mtmd-helper-gen.cpp clip.cpp; do
  echo "tools/mtmd/$f" >>"$list"
done
for f in "$src"/tools/mtmd/models/*.cpp; do echo "${f#$src/}" >>"$list"; done
echo vendor/hash/hash.cpp >>"$list"
echo ui/ui.cpp >>"$list"
export src obj inc
xargs -P 2 -I{} sh -c '
  f={}; o="$obj/$(echo "$f" | tr / _).o"
  [ -f "$o" ] && exit 0
  case "$f" in *.c) c="g++ -x c++" ;; *) c="g++" ;; esac
  case "$f" in ui/*) p="$obj/$f" ;; *) p="$src/$f" ;; esac
  $c -std=c++17 -O2 -w -DLLAMA_SHARED -DNDEBUG $inc -c "$p" -o "$o.tmp" && mv "$o.tmp" "$o"
' <"$list" || fail "compiling the server failed"
for f in xxhash/xxhash.c sha1/sha1.c sha256/sha256.c; do
  o="$obj/vendor_hash_$(echo "$f" | tr / _).o"
  [ -f "$o" ] && continue
  case "$f" in sha1/*) c="g++ -x c++ -std=c++17" ;; *) c="gcc" ;; esac
  $c -O2 -w -I"$src/vendor/hash" -c "$src/vendor/hash/$f" -o "$o"
done
g++ -o "$bin.tmp" "$obj"/*.o -L"$libdir" -Wl,-rpath,"$libdir" \
  -l:libllama-common.so -l:libllama.v0.5.0.so -l:libggml.v0.5.0.so -l:libggml-base.so \
  -lpthread -ldl || fail "linking llama-server failed"
# ggml loads its CPU backend at run time from the executable's directory
for f in "$libdir"/libggml-cpu-*.so; do ln -sf "$f" "$cache/"; done
mv "$bin.tmp" "$bin"
echo "$bin"
