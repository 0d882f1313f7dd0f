# kvrope — top-level build.
#
#   make            build the daemon (kvroped), the CLI (kvrope), libkvrope, tests
#   make run        install what is missing to run (not to test), build what a user
#                   needs, run kvroped (and kvrope serve) with embedded defaults
#   make test       install what is missing, build, run every test
#   make test-fast  the rope, codec, cache and proto unit tests alone (no daemon,
#                   no llama.cpp, no Python), four binaries at a time: under a
#                   minute
#   make check      the tests under ASan + UBSan with libc malloc (build/check),
#                   and make check-symbols (the kvr_ / kvr__ naming line)
#   make check-symbols  nm over every archive: globals carry kvr_ or kvr__
#   make bench      the benchmarks (ratios against memcpy, Redis, ggml in the same run)
#   make fuzz       libFuzzer targets (clang), a short run of each
#   make fuzz-ci    every fuzz target for a few seconds from tests/fuzz/corpus (CI)
#   make soak       the long crash run: 1,000 kill -9 trials (CI runs 100)
#   make install    PREFIX=/usr/local DESTDIR= : binaries, libkvrope, headers,
#                   kvrope.pc, the Python package, man pages, systemd units,
#                   an example config
#   make uninstall  removes what install put there (not the config file)
#   make clean
#
# MODE=release (default: -O2, -DNDEBUG, jemalloc), MODE=debug (-O0, assert()
# on, jemalloc), MODE=check (ASan + UBSan, assert() on, libc malloc), MODE=fuzz.
#
# Sources are picked up by directory, so adding a file needs no edit here:
#   base/*.c rope/*.c cache/*.c proto/*.c -> one archive each (base/ and rope/
#                                        also in libkvrope)
#   daemon/*.c (but main.c)             -> internal archive;  daemon/main.c -> kvroped
#   client/lib/*.c                      -> libkvrope.a / libkvrope.so
#   client/cli/*.c                      -> kvrope
#   tests/unit/test_*.c                 -> one Criterion binary each (in-process)
#   tests/int/test_*.c                  -> one Criterion binary each; these start
#                                          kvroped, the CLI or Redis themselves
#   tests/common/*.c                    -> libtestcommon.a, linked by every test and
#                                          benchmark (kvt_bench.c needs no Criterion)
#   tests/common/*.h                    -> their declarations (no code in headers)
#   tests/bench/bench_*.c               -> one benchmark binary each
#   tests/fuzz/fuzz_*.c                 -> one libFuzzer target each
#   client/llama/, tests/llama/         -> see client/llama/llama.mk (llama.cpp from npm)
# Files named *_avx2.c / *_avx512.c get the ISA flags for that file only: the
# shipped binary runs on any x86-64 and picks its kernels at run time.

BUILD   ?= build
MODE    ?= release
CC      ?= cc
SHARED  ?= $(abspath ../shared)
PYTHON  := /usr/bin/python3

WARN := -std=c11 -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes \
        -Wmissing-prototypes -Wpointer-arith -Wcast-qual -Wdouble-promotion \
        -Wformat=2 -Werror
GEN  := $(BUILD)/gen
CPPFLAGS := -D_GNU_SOURCE -I. -I$(GEN)/proto -MMD -MP
CFLAGS_BASE := $(WARN) -fPIC -pthread -fvisibility=default
LIBS := -luv -luring -lprotobuf-c -lcjson -lmicrohttpd -lsystemd -lhiredis -lsodium -lm -lpthread -ldl

ifeq ($(MODE),fuzz)
  CC := clang
  # clang 14 flags glibc's float NAN/INFINITY macros under -Wdouble-promotion;
  # the gcc builds keep the warning.
  OPT := -g -O1 -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer \
         -Wno-double-promotion
  LDSAN := -fsanitize=fuzzer,address,undefined
  MALLOC_LIB :=
else ifeq ($(MODE),check)
  OPT := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer \
         -fno-sanitize-recover=undefined
  LDSAN := -fsanitize=address,undefined
  MALLOC_LIB :=
else ifeq ($(MODE),debug)
  OPT := -O0 -g
  LDSAN :=
  MALLOC_LIB := -ljemalloc
  CPPFLAGS += -DKVR_JEMALLOC=1
else
  # Only the release build drops assert(): check, debug and fuzz builds run
  # every invariant check.
  OPT := -O2 -g -DNDEBUG
  LDSAN :=
  MALLOC_LIB := -ljemalloc
  CPPFLAGS += -DKVR_JEMALLOC=1
endif
CFLAGS ?=
ALL_CFLAGS = $(CFLAGS_BASE) $(OPT) $(XFLAGS) $(CFLAGS)
LDFLAGS_ALL = $(LDSAN) -pthread $(LDFLAGS)

AVX2_FLAGS   := -mavx2 -mfma -mf16c
AVX512_FLAGS := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c

# ---- sources ---------------------------------------------------------------
PROTO_GEN_C := $(GEN)/proto/kvrope.pb-c.c
PROTO_GEN_H := $(GEN)/proto/kvrope.pb-c.h

BASE_SRC   := $(wildcard base/*.c)
ROPE_SRC   := $(wildcard rope/*.c)
CACHE_SRC  := $(wildcard cache/*.c)
PROTO_SRC  := $(wildcard proto/*.c)
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c))
CLIB_SRC   := $(wildcard client/lib/*.c)
CLI_SRC    := $(wildcard client/cli/*.c)
UNIT_SRC   := $(wildcard tests/unit/test_*.c)
INT_SRC    := $(wildcard tests/int/test_*.c)
TESTCOMMON_SRC := $(wildcard tests/common/*.c)
BENCH_SRC  := $(wildcard tests/bench/bench_*.c)
FUZZ_SRC   := $(wildcard tests/fuzz/fuzz_*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

BASE_OBJ   := $(call obj,$(BASE_SRC))
ROPE_OBJ   := $(call obj,$(ROPE_SRC))
CACHE_OBJ  := $(call obj,$(CACHE_SRC))
PROTO_OBJ  := $(call obj,$(PROTO_SRC)) $(BUILD)/obj/gen/kvrope.pb-c.o
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
CLIB_OBJ   := $(call obj,$(CLIB_SRC))
CLI_OBJ    := $(call obj,$(CLI_SRC))

# One archive per module, linked in layering order, so a test links only the
# modules it exercises (test_rope_* needs rope/ and base/, test_cache_* cache/,
# rope/ and base/, everything else all of them). base/ is the foundation
# every other archive builds on (docs/base.md), so it comes last.
BASE_A   := $(BUILD)/lib/libbase.a
ROPE_A   := $(BUILD)/lib/librope.a
CACHE_A  := $(BUILD)/lib/libcache.a
PROTO_A  := $(BUILD)/lib/libproto.a
DAEMON_A := $(BUILD)/lib/libdaemon.a
CLIB_A   := $(BUILD)/lib/libclient.a
ALL_A    := $(DAEMON_A) $(CLIB_A) $(CACHE_A) $(PROTO_A) $(ROPE_A) $(BASE_A)
# The tests' shared fixtures (tests/common/*.c): each test links the archive
# right after its own object, so it pulls only the helpers it calls (and the
# modules those need, which its rule links anyway).
TESTCOMMON_A := $(BUILD)/lib/libtestcommon.a

# libkvrope's version: client/kvrope.h's KVR_VERSION_* (read here, not repeated).
KVR_VER := $(shell awk '/^\#define KVR_VERSION_(MAJOR|MINOR|PATCH) /{v=v s $$3; s="."} END{print v}' client/kvrope.h)
KVR_SOMAJOR := $(firstword $(subst ., ,$(KVR_VER)))
CLIENT_A   := $(BUILD)/libkvrope.a
CLIENT_SO  := $(BUILD)/libkvrope.so
CLIENT_SONAME := libkvrope.so.$(KVR_SOMAJOR)
CLIENT_SOREAL := $(BUILD)/libkvrope.so.$(KVR_VER)
CLIENT_MAP := client/lib/kvrope.map
KVROPED    := $(BUILD)/kvroped
KVROPE     := $(BUILD)/kvrope
UNIT_TESTS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
INT_TESTS  := $(patsubst tests/int/%.c,$(BUILD)/tests/%,$(INT_SRC))
TESTS      := $(UNIT_TESTS) $(INT_TESTS)
# make test-fast: the in-process tests of rope/, the codecs, cache/ (the disk
# tier included) and proto/, but for two stress runs make test keeps: the
# 32 MiB streamed gets (test_cache_get_into, a minute and more of one core)
# and the kill -9 trials (test_disk_crash).
FAST_SLOW  := $(addprefix $(BUILD)/tests/,test_cache_get_into test_disk_crash)
# They run four binaries at a time (scripts/run-tests.sh --parallel), the
# longest first so that none is left running alone at the end.
FAST_FIRST := $(addprefix $(BUILD)/tests/,test_cache_edit test_disk_log test_disk_spill \
                test_disk_faults test_disk_format test_cache_tier)
FAST_TESTS := $(filter-out $(FAST_SLOW),$(filter $(addprefix $(BUILD)/tests/test_,rope_% codec_% \
                cache_% disk_% proto_%),$(UNIT_TESTS)))
FAST_TESTS := $(filter $(FAST_TESTS),$(FAST_FIRST)) $(filter-out $(FAST_FIRST),$(FAST_TESTS))
BENCHES    := $(patsubst tests/bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))
FUZZERS    := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(FUZZ_SRC))

# The trained eval model's GGUF (made from eval/model; see "the trained eval model" below).
EVAL_GGUF := $(BUILD)/eval/kvrope-code.gguf

# llama.cpp: the bridge (into libkvrope), and what links libllama (fetched from npm).
include client/llama/llama.mk

.PHONY: deps-run deps-eval eval eval-reuse eval-model deps-fuzz fuzz-ci soak fuzzers all deps deps-bench run test test-fast check bench fuzz clean \
        check-symbols install uninstall
.DEFAULT_GOAL := all
# Every file make builds is kept: the test and bench objects are intermediate
# (built only on the way to their binary), and make would delete them after
# each build and rebuild them all on the next one.
.SECONDARY:

all: $(KVROPED) $(KVROPE) $(CLIENT_A) $(CLIENT_SO) $(TESTS) $(BENCHES) $(LLAMA_PROGS) $(EVAL_GGUF)

deps:
	@scripts/deps.sh test

deps-bench:
	@scripts/deps.sh bench

deps-fuzz:
	@scripts/deps.sh fuzz

deps-eval:
	@scripts/deps.sh eval

# ---- code generation -------------------------------------------------------
$(PROTO_GEN_C) $(PROTO_GEN_H) &: proto/kvrope.proto
	@mkdir -p $(GEN)/proto
	protoc-c --proto_path=proto --c_out=$(GEN)/proto proto/kvrope.proto

# Generated code is not ours to fix; it is compiled without our warning set.
$(BUILD)/obj/gen/kvrope.pb-c.o: $(PROTO_GEN_C)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -fPIC -pthread $(OPT) -w -c $< -o $@

# ---- objects ---------------------------------------------------------------
$(BUILD)/obj/%_avx2.o:   XFLAGS += $(AVX2_FLAGS)
$(BUILD)/obj/%_avx512.o: XFLAGS += $(AVX512_FLAGS)
# The sin/cos tables, the ggml block kernels and the row codecs (their
# decoders and the error measure): the SIMD versions must round every product
# and sum as the scalar one does (no fused multiply-add), so all ISAs agree
# bit for bit.
$(BUILD)/obj/rope/rope.o $(BUILD)/obj/rope/sincos_avx2.o $(BUILD)/obj/rope/sincos_avx512.o \
  $(BUILD)/obj/cache/codec_ggml_avx2.o $(BUILD)/obj/cache/codec_ggml_avx512.o \
  $(BUILD)/obj/cache/codec_avx2.o $(BUILD)/obj/cache/codec_avx512.o: \
  XFLAGS += -ffp-contract=off

$(BUILD)/obj/%.o: %.c | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(ALL_CFLAGS) -c $< -o $@

define archive
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^
endef
$(BASE_A):   $(BASE_OBJ)   ; $(archive)
$(ROPE_A):   $(ROPE_OBJ)   ; $(archive)
$(CACHE_A):  $(CACHE_OBJ)  ; $(archive)
$(PROTO_A):  $(PROTO_OBJ)  ; $(archive)
$(DAEMON_A): $(DAEMON_OBJ) ; $(archive)
$(CLIB_A):   $(CLIB_OBJ)   ; $(archive)
$(TESTCOMMON_A): $(call obj,$(TESTCOMMON_SRC)) ; $(archive)

# The public client library bundles what it needs of proto/, rope/ and base/.
$(CLIENT_A): $(CLIB_OBJ) $(PROTO_OBJ) $(ROPE_OBJ) $(BASE_OBJ) ; $(archive)

# The shared library: SONAME libkvrope.so.MAJOR, the file libkvrope.so.X.Y.Z,
# the usual symlinks (libkvrope.so.MAJOR for the loader, libkvrope.so for the
# linker and the Python binding), kvr_* exported only (client/lib/kvrope.map).
$(CLIENT_SOREAL): $(CLIB_OBJ) $(PROTO_OBJ) $(ROPE_OBJ) $(BASE_OBJ) $(CLIENT_MAP)
	$(CC) -shared $(LDFLAGS_ALL) -Wl,-soname,$(CLIENT_SONAME) \
	  -Wl,--version-script=$(CLIENT_MAP) -o $@ $(filter %.o,$^) -lprotobuf-c -lcjson -lm -lpthread

$(CLIENT_SO): $(CLIENT_SOREAL)
	ln -sf $(notdir $(CLIENT_SOREAL)) $(BUILD)/$(CLIENT_SONAME)
	ln -sf $(CLIENT_SONAME) $@

$(KVROPED): $(BUILD)/obj/daemon/main.o $(ALL_A)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

$(KVROPE): $(CLI_OBJ) $(ALL_A)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

$(BUILD)/tests/test_rope%: $(BUILD)/obj/tests/unit/test_rope%.o $(TESTCOMMON_A) $(ROPE_A) $(BASE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

# `kvrope rope` runs without a daemon: its test links the CLI's file for it.
$(BUILD)/tests/test_rope_cli: $(BUILD)/obj/tests/unit/test_rope_cli.o $(TESTCOMMON_A) \
  $(call obj,client/cli/cli_rope.c) $(ROPE_A) $(BASE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

# Codec kernels (cache/codec*.c) test on their own, without the store.
CODEC_OBJ := $(call obj,$(wildcard cache/codec*.c))
$(BUILD)/tests/test_codec%: $(BUILD)/obj/tests/unit/test_codec%.o $(TESTCOMMON_A) $(CODEC_OBJ) $(ROPE_A) $(BASE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

$(BUILD)/bench/bench_codec: $(BUILD)/obj/tests/bench/bench_codec.o $(TESTCOMMON_A) $(CODEC_OBJ) $(ROPE_A) $(BASE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

$(BUILD)/tests/test_cache%: $(BUILD)/obj/tests/unit/test_cache%.o $(TESTCOMMON_A) $(CACHE_A) $(ROPE_A) $(BASE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

# Start-up failure tests make chosen allocations fail (tests/unit/test_daemon_start.c).
$(BUILD)/tests/test_daemon_start: LDFLAGS += -Wl,--wrap=kvr_mem_malloc

$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(TESTCOMMON_A) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

# The tests that start a daemon, the CLI or Redis (tests/int/) link everything.
$(INT_TESTS): $(BUILD)/tests/%: $(BUILD)/obj/tests/int/%.o $(TESTCOMMON_A) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

$(BUILD)/bench/bench_rope%: $(BUILD)/obj/tests/bench/bench_rope%.o $(TESTCOMMON_A) $(ROPE_A) $(BASE_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

$(BUILD)/bench/%: $(BUILD)/obj/tests/bench/%.o $(TESTCOMMON_A) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

# libFuzzer targets: only built in MODE=fuzz (clang), see `make fuzz`. The
# CLI's parsers (cli_parse.h) link the two CLI files that hold them.
CLI_PARSE_OBJ := $(call obj,client/cli/cli_files.c client/cli/cli_ops.c)
$(BUILD)/fuzz/fuzz_cli_%: $(BUILD)/obj/tests/fuzz/fuzz_cli_%.o $(CLI_PARSE_OBJ) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS)

# A fuzz target links the one compiled fixture it may use (no Criterion in it),
# not the fixtures' archive, which the fuzz build does not make.
$(BUILD)/fuzz/%: $(BUILD)/obj/tests/fuzz/%.o $(BUILD)/obj/tests/common/kvt_inproc.o $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS)

fuzzers: $(FUZZERS)

# ---- running ---------------------------------------------------------------
# What a user runs: the daemon, the CLI, libkvrope (the Python binding loads
# it; C programs link it), kvrope-llama and the served model (when llama.cpp's
# libraries could be fetched); only run-time packages (scripts/deps.sh run).
# scripts/run-daemon.sh says where the socket, the disk tier and the server are.
RUN_PROGS := $(KVROPED) $(KVROPE) $(CLIENT_SO) $(CLIENT_A) $(LLAMA_PROGS) \
             $(if $(LLAMA_PROGS),$(EVAL_GGUF))
run: deps-run
	@$(MAKE) --no-print-directory $(RUN_PROGS)
	@scripts/run-daemon.sh $(KVROPED)

deps-run:
	@scripts/deps.sh run

test: deps
	@$(MAKE) --no-print-directory all
	@KVR_BUILD=$(abspath $(BUILD)) KVR_VECTORS=$(SHARED)/vectors KVR_CONFIGS=$(SHARED)/configs \
	  PYTHON=$(PYTHON) scripts/run-tests.sh

# No deps step and no `all`: only what these tests link is built.
test-fast: $(FAST_TESTS)
	@KVR_BUILD=$(abspath $(BUILD)) KVR_VECTORS=$(SHARED)/vectors KVR_CONFIGS=$(SHARED)/configs \
	  scripts/run-tests.sh --c-only --parallel 4 $(FAST_TESTS)

check: deps
	@$(MAKE) --no-print-directory BUILD=build/check MODE=check all
	@$(MAKE) --no-print-directory BUILD=build/check MODE=check check-symbols
	@KVR_BUILD=$(abspath build/check) KVR_VECTORS=$(SHARED)/vectors KVR_CONFIGS=$(SHARED)/configs \
	  KVR_SANITIZE=1 \
	  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  LSAN_OPTIONS=suppressions=$(abspath tests/lsan.supp) \
	  scripts/run-tests.sh --c-only

bench: deps-bench
	@$(MAKE) --no-print-directory all
	@KVR_BUILD=$(abspath $(BUILD)) KVR_VECTORS=$(SHARED)/vectors scripts/run-bench.sh

# ---- the trained eval model (docs/eval.md) ----------------------------------
# eval/model holds the committed float16 weights; the GGUF llama.cpp runs is
# made from them (same weights in both engines; a vocabulary of 267 gets the
# FIM token ids under llama.cpp's keys). `make eval-model` retrains it from
# random weights (eval/train.py: half the rows fill-in-the-middle in the
# suffix-first layout, 16 unscored FIM_MID tokens sprinkled into each
# left-to-right row, context 1024, bfloat16 matrix products; about 33 min on
# the 2-core machine), re-exports, and scores the GGUF on the held-out code
# (eval/score.py). `make eval` writes docs/eval.md and docs/eval/*.png (the
# README keeps a summary line; not part of make test).
# The committed model's run (lr: docs/eval.md says how it was chosen): 1200
# steps (decay over the last 360, the last 150 on whole-context rows); it
# resumes from the checkpoint in $(BUILD)/eval/train when interrupted.
EVAL_TRAIN_ARGS  := --batch 16 --seq 512 --context 1024 --spm --fim 0.5 --repo 0.5 --mid-weight 2 \
                    --mid-first 4 --mid-first-weight 10 --fim-batches 128,192,384,768 --mid-noise 16 \
                    --lr 5e-3 --threads 2 --eval-every 300 --eval-bytes 8192 --no-final-eval
$(EVAL_GGUF): eval/model/weights.npz eval/model/config.json scripts/gen-gguf.py
	@mkdir -p $(dir $@)
	@$(PYTHON) scripts/gen-gguf.py -o $@.tmp --hf eval/model --dtype f16 --name kvrope-code && mv $@.tmp $@

eval-model: deps-eval
	$(PYTHON) eval/train.py --out $(BUILD)/eval/train $(EVAL_TRAIN_ARGS) --steps 1200 --long-from 1050
	$(PYTHON) eval/export.py $(BUILD)/eval/train eval/model
	@$(MAKE) --no-print-directory $(EVAL_GGUF) $(KVROPE_LLAMA)
	$(PYTHON) eval/score.py --build $(BUILD)

eval: deps-eval
	@$(MAKE) --no-print-directory all
	KVR_BUILD=$(abspath $(BUILD)) $(PYTHON) eval/run.py
	KVR_BUILD=$(abspath $(BUILD)) nice $(PYTHON) eval/reuse.py

# Reuse anywhere alone (a few minutes): chunks cached in one prompt,
# placed in another by kvroped's re-rotation, seams repaired by the engine
# (kvrope-llama repair); the table into docs/eval.md, docs/eval/reuse.png.
eval-reuse: deps-eval
	@$(MAKE) --no-print-directory $(KVROPED) $(CLIENT_SO) $(EVAL_GGUF) $(KVROPE_LLAMA)
	KVR_BUILD=$(abspath $(BUILD)) nice $(PYTHON) eval/reuse.py

# The long crash run: 1,000 kill -9 trials through the daemon and 1,000
# against the storage layer (CI runs 100 of each inside `make test`).
soak: deps
	@$(MAKE) --no-print-directory $(BUILD)/kvroped $(BUILD)/tests/test_int_disk $(BUILD)/tests/test_disk_crash
	@KVR_BUILD=$(abspath $(BUILD)) KVR_DISK_KILL_TRIALS=$${KVR_DISK_KILL_TRIALS:-1000} \
	  KVR_DISK_CRASH_TRIALS=$${KVR_DISK_CRASH_TRIALS:-1000} \
	  sh -c '$(BUILD)/tests/test_disk_crash && $(BUILD)/tests/test_int_disk --filter "*kill*"'

fuzz: deps-fuzz
	@$(MAKE) --no-print-directory BUILD=build/fuzz MODE=fuzz fuzzers
	@scripts/run-fuzz.sh build/fuzz

# CI's short run: every target for FUZZ_CI_SECONDS (default 4) from the
# committed seeds in tests/fuzz/corpus/<target>/.
fuzz-ci: deps-fuzz
	@$(MAKE) --no-print-directory BUILD=build/fuzz MODE=fuzz fuzzers
	@FUZZ_SECONDS=$${FUZZ_CI_SECONDS:-4} scripts/run-fuzz.sh build/fuzz

# The naming line (docs/base.md): every global symbol of every archive, of
# the CLI's objects and of the worker's main carries kvr_ (a room's public
# API) or kvr__ (a room's cross-file internals). Documented exceptions: main;
# kvrope__* (protoc-c's code generated from proto/kvrope.proto, package
# kvrope); LLVMFuzzerTestOneInput and friends (fuzz targets, not archived).
# libkvrope.so exports exactly the functions and data its installed headers
# declare (client/kvrope.h, client/llama/kvrope_llama.h and every header they
# include), never a kvr__ name, and has its SONAME. Part of `make check`.
# (__odr_asan.* and __asan_* are ASan's own globals beside each instrumented
# one in the check build.)
SYMBOL_EXCEPTIONS := main|kvrope__.*|LLVMFuzzer.*|__odr_asan\..*|__asan_.*|__ubsan_.*|__sancov_.*
CHECK_SYMBOL_OBJS := $(ALL_A) $(CLI_OBJ) $(WORKER_A) \
                     $(if $(WORKER_A),$(BUILD)/obj/client/llama/worker_main.o)
check-symbols: $(CLIENT_SO) $(CHECK_SYMBOL_OBJS)
	@bad=$$(nm -D --defined-only $(CLIENT_SOREAL) | awk '$$2 ~ /[TDBRVW]/ {print $$3}' | \
	  sed 's/@.*//' | grep -v -E '^(_init|_fini|_edata|_end|__bss_start)$$' | \
	  while read -r s; do \
	    case $$s in kvr__*) echo "$$s"; continue;; esac; \
	    grep -qw -- "$$s" client/kvrope.h client/llama/kvrope_llama.h $(INSTALL_HEADERS) || echo "$$s"; \
	  done); \
	if [ -n "$$bad" ]; then echo "libkvrope.so exports what no installed header declares:"; \
	  echo "$$bad"; exit 1; fi; \
	so=$$(readelf -d $(CLIENT_SOREAL) | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p'); \
	if [ "$$so" != "$(CLIENT_SONAME)" ]; then echo "SONAME is '$$so', want $(CLIENT_SONAME)"; exit 1; fi; \
	n=$$(nm -D --defined-only $(CLIENT_SOREAL) | grep -c ' [TDBRVW] kvr_'); \
	echo "check-symbols: libkvrope.so ok ($$n kvr_* exports, each in an installed header; SONAME $$so)"
	@bad=$$(for f in $(CHECK_SYMBOL_OBJS); do \
	    nm -g --defined-only $$f 2>/dev/null | awk -v f=$$f '$$2 ~ /^[A-TV-Z]$$/ {print f ": " $$3}'; \
	  done | grep -v -E ': (kvr_|kvr__)' | grep -v -E ': ($(SYMBOL_EXCEPTIONS))$$' | sort -u); \
	if [ -n "$$bad" ]; then echo "global symbols without kvr_ / kvr__:"; echo "$$bad"; exit 1; fi; \
	echo "check-symbols: every archive's globals carry kvr_ or kvr__ ($(words $(CHECK_SYMBOL_OBJS)) files)"

# ---- install ----------------------------------------------------------------
# GNU-style directories; DESTDIR is prepended to every path (staging).
PREFIX      ?= /usr/local
BINDIR      ?= $(PREFIX)/bin
LIBDIR      ?= $(PREFIX)/lib
INCLUDEDIR  ?= $(PREFIX)/include
DATADIR     ?= $(PREFIX)/share
MANDIR      ?= $(DATADIR)/man
DOCDIR      ?= $(DATADIR)/doc/kvrope
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
ifeq ($(PREFIX),/usr)
  SYSCONFDIR ?= /etc
  UNITDIR    ?= /usr/lib/systemd/system
  SYSUSERSDIR ?= /usr/lib/sysusers.d
else
  SYSCONFDIR ?= $(PREFIX)/etc
  UNITDIR    ?= $(PREFIX)/lib/systemd/system
  SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
endif
INSTALL ?= install
KVR_VERSION := $(shell sed -n 's/^\#define KVR_DAEMON_VERSION "\(.*\)"/\1/p' daemon/daemon.h)
# kvrope.pc's Version: the library's (KVR_VER, when the build defines it).
KVR_PC_VERSION = $(if $(KVR_VER),$(KVR_VER),$(KVR_VERSION))
# What the build produces for the client library: the shared object (its
# real file, its SONAME link and the libkvrope.so link are derived from it
# at install time, so a SONAME'd build installs its symlinks too) and the
# archive. Public headers: client/kvrope.h (as kvrope/kvrope.h) and every
# project header it includes, directly or not (INSTALL_HEADERS, found by
# following its #include "..." lines), each under kvrope/ at its path.
INSTALL_SO      ?= $(CLIENT_SO)
INSTALL_A       ?= $(CLIENT_A)
# The llama.cpp bridge's header is installed as kvrope/kvrope_llama.h (its
# #include "client/kvrope.h" then finds kvrope/client/kvrope.h).
INSTALL_HEADERS ?= $(shell scripts/public-headers.sh client/kvrope.h client/llama/kvrope_llama.h)
# The Python package, where Debian's python3 finds it: /usr/lib/python3/
# dist-packages for PREFIX=/usr, else PREFIX/lib/python3.N/dist-packages
# (/usr/local/lib/python3.11/dist-packages is on Debian 12's sys.path). A
# generated kvrope/_install.py tells it where libkvrope was installed.
PYVER := $(shell $(PYTHON) -c 'import sys; print("python%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(PREFIX),/usr)
  PYTHONDIR ?= /usr/lib/python3/dist-packages
else
  PYTHONDIR ?= $(PREFIX)/lib/$(if $(PYVER),$(PYVER),python3)/dist-packages
endif
PY_SRC := $(wildcard client/python/kvrope/*.py)
UNITS := kvroped.service kvroped.socket kvroped-metrics.socket
SUBST = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@BINDIR@|$(BINDIR)|g' \
            -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' \
            -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' -e 's|@VERSION@|$(KVR_VERSION)|g' \
            -e 's|@LIBVERSION@|$(KVR_PC_VERSION)|g'

# INSTALL_DEPS= (empty) installs what is built without checking it is up
# to date (the install test does, so it never builds under a running suite).
INSTALL_DEPS ?= $(KVROPED) $(KVROPE) $(INSTALL_SO) $(INSTALL_A)
install: $(INSTALL_DEPS)
	$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) \
	  $(DESTDIR)$(INCLUDEDIR)/kvrope $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8 \
	  $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(SYSCONFDIR)/kvrope $(DESTDIR)$(DOCDIR)
	$(INSTALL) -m 755 $(KVROPED) $(KVROPE) $(DESTDIR)$(BINDIR)/
	@real=$$(readlink -f $(INSTALL_SO)); file=$$(basename $$real); \
	soname=$$(objdump -p $$real | awk '$$1 == "SONAME" {print $$2}'); \
	echo "$(INSTALL) -m 755 $$real $(DESTDIR)$(LIBDIR)/$$file"; \
	$(INSTALL) -m 755 $$real $(DESTDIR)$(LIBDIR)/$$file || exit 1; \
	if [ -n "$$soname" ] && [ "$$soname" != "$$file" ]; then \
	  echo "ln -sf $$file $(DESTDIR)$(LIBDIR)/$$soname"; ln -sf $$file $(DESTDIR)$(LIBDIR)/$$soname; fi; \
	if [ "$$file" != libkvrope.so ]; then \
	  link=$${soname:-$$file}; echo "ln -sf $$link $(DESTDIR)$(LIBDIR)/libkvrope.so"; \
	  ln -sf $$link $(DESTDIR)$(LIBDIR)/libkvrope.so; fi
	$(INSTALL) -m 644 $(INSTALL_A) $(DESTDIR)$(LIBDIR)/
	$(INSTALL) -m 644 client/kvrope.h client/llama/kvrope_llama.h $(DESTDIR)$(INCLUDEDIR)/kvrope/
	for h in $(INSTALL_HEADERS); do $(INSTALL) -D -m 644 $$h $(DESTDIR)$(INCLUDEDIR)/kvrope/$$h || exit 1; done
	$(INSTALL) -d $(DESTDIR)$(PYTHONDIR)/kvrope
	$(INSTALL) -m 644 $(PY_SRC) $(DESTDIR)$(PYTHONDIR)/kvrope/
	printf '# Written by make install: where libkvrope was installed.\nLIBDIR = "%s"\n' \
	  '$(LIBDIR)' > $(DESTDIR)$(PYTHONDIR)/kvrope/_install.py
	$(SUBST) dist/kvrope.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/kvrope.pc
	$(SUBST) dist/man/kvrope.1 > $(DESTDIR)$(MANDIR)/man1/kvrope.1
	$(SUBST) dist/man/kvroped.8 > $(DESTDIR)$(MANDIR)/man8/kvroped.8
	for u in $(UNITS); do $(SUBST) dist/systemd/$$u.in > $(DESTDIR)$(UNITDIR)/$$u || exit 1; done
	$(INSTALL) -m 644 dist/systemd/kvrope.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvrope.conf
	$(INSTALL) -m 644 dist/kvroped.conf $(DESTDIR)$(DOCDIR)/kvroped.conf.example
	$(INSTALL) -m 644 docs/operations.md docs/protocol.md docs/formats.md $(DESTDIR)$(DOCDIR)/
	@# The config is the operator's once it exists: never overwritten.
	@if [ ! -e $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf ]; then \
	  echo "$(INSTALL) -m 644 dist/kvroped.conf $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf"; \
	  $(INSTALL) -m 644 dist/kvroped.conf $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf; \
	else echo "kept $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf"; fi

# Removes what install put there. The config file is kept if it differs
# from the example (it is the operator's then).
uninstall:
	rm -f $(DESTDIR)$(BINDIR)/kvroped $(DESTDIR)$(BINDIR)/kvrope
	rm -f $(DESTDIR)$(LIBDIR)/libkvrope.so $(DESTDIR)$(LIBDIR)/libkvrope.so.* \
	  $(DESTDIR)$(LIBDIR)/libkvrope.a $(DESTDIR)$(PKGCONFIGDIR)/kvrope.pc
	rm -f $(DESTDIR)$(INCLUDEDIR)/kvrope/kvrope.h $(DESTDIR)$(INCLUDEDIR)/kvrope/kvrope_llama.h
	rm -rf $(DESTDIR)$(PYTHONDIR)/kvrope
	for h in $(INSTALL_HEADERS); do rm -f $(DESTDIR)$(INCLUDEDIR)/kvrope/$$h; \
	  rmdir $$(dirname $(DESTDIR)$(INCLUDEDIR)/kvrope/$$h) 2>/dev/null || true; done
	-rmdir $(DESTDIR)$(INCLUDEDIR)/kvrope 2>/dev/null
	rm -f $(DESTDIR)$(MANDIR)/man1/kvrope.1 $(DESTDIR)$(MANDIR)/man8/kvroped.8
	for u in $(UNITS); do rm -f $(DESTDIR)$(UNITDIR)/$$u; done
	rm -f $(DESTDIR)$(SYSUSERSDIR)/kvrope.conf
	rm -f $(DESTDIR)$(DOCDIR)/kvroped.conf.example $(DESTDIR)$(DOCDIR)/operations.md \
	  $(DESTDIR)$(DOCDIR)/protocol.md $(DESTDIR)$(DOCDIR)/formats.md
	-rmdir $(DESTDIR)$(DOCDIR) 2>/dev/null
	@if cmp -s dist/kvroped.conf $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf; then \
	  echo "rm -f $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf"; \
	  rm -f $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf; \
	  rmdir $(DESTDIR)$(SYSCONFDIR)/kvrope 2>/dev/null || true; \
	elif [ -e $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf ]; then \
	  echo "kept $(DESTDIR)$(SYSCONFDIR)/kvrope/kvroped.conf (changed)"; fi

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
