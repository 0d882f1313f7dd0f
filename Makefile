# kvrope — top-level build.
#
#   make            build the daemon (kvroped), the CLI (kvrope), libkvrope, tests
#   make run        install what is missing, build, run kvroped with embedded defaults
#   make test       install what is missing, build, run every test
#   make check      the tests under ASan + UBSan with libc malloc (build/check)
#   make bench      the benchmarks (ratios against memcpy, Redis, ggml in the same run)
#   make fuzz       libFuzzer targets (clang), a short run of each
#   make clean
#
# Sources are picked up by directory, so adding a file needs no edit here:
#   rope/*.c cache/*.c proto/*.c        -> internal archive (and libkvrope)
#   daemon/*.c (but main.c)             -> internal archive;  daemon/main.c -> kvroped
#   client/lib/*.c                      -> libkvrope.a / libkvrope.so
#   client/cli/*.c                      -> kvrope
#   tests/unit/test_*.c                 -> one Criterion binary each
#   tests/bench/bench_*.c               -> one benchmark binary each
#   tests/fuzz/fuzz_*.c                 -> one libFuzzer target each
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
LIBS := -luv -luring -lprotobuf-c -lcjson -lm -lpthread -ldl

ifeq ($(MODE),check)
  OPT := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer \
         -fno-sanitize-recover=undefined
  LDSAN := -fsanitize=address,undefined
  MALLOC_LIB :=
else
  OPT := -O2 -g
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

ROPE_SRC   := $(wildcard rope/*.c)
CACHE_SRC  := $(wildcard cache/*.c)
PROTO_SRC  := $(wildcard proto/*.c)
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c))
CLIB_SRC   := $(wildcard client/lib/*.c)
CLI_SRC    := $(wildcard client/cli/*.c)
TEST_SRC   := $(wildcard tests/unit/test_*.c)
BENCH_SRC  := $(wildcard tests/bench/bench_*.c)
FUZZ_SRC   := $(wildcard tests/fuzz/fuzz_*.c)
THELP_SRC  := $(wildcard tests/common/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))

ROPE_OBJ   := $(call obj,$(ROPE_SRC))
CACHE_OBJ  := $(call obj,$(CACHE_SRC))
PROTO_OBJ  := $(call obj,$(PROTO_SRC)) $(BUILD)/obj/gen/kvrope.pb-c.o
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
CLIB_OBJ   := $(call obj,$(CLIB_SRC))
CLI_OBJ    := $(call obj,$(CLI_SRC))
THELP_OBJ  := $(call obj,$(THELP_SRC))

INTERNAL_A := $(BUILD)/libkvr-internal.a
CLIENT_A   := $(BUILD)/libkvrope.a
CLIENT_SO  := $(BUILD)/libkvrope.so
KVROPED    := $(BUILD)/kvroped
KVROPE     := $(BUILD)/kvrope
TESTS      := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(TEST_SRC))
BENCHES    := $(patsubst tests/bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

.PHONY: all deps deps-bench run test test-c test-py check bench fuzz clean check-symbols
.DEFAULT_GOAL := all

all: $(KVROPED) $(KVROPE) $(CLIENT_A) $(CLIENT_SO) $(TESTS) $(BENCHES)

deps:
	@scripts/deps.sh test

deps-bench:
	@scripts/deps.sh bench

# ---- code generation -------------------------------------------------------
$(PROTO_GEN_C) $(PROTO_GEN_H) &: proto/kvrope.proto
	@mkdir -p $(GEN)/proto
	protoc-c --proto_path=proto --c_out=$(GEN)/proto proto/kvrope.proto

# Generated code is not ours to fix; it gets the plain warnings only.
$(BUILD)/obj/gen/kvrope.pb-c.o: $(PROTO_GEN_C)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -fPIC -pthread $(OPT) -w -c $< -o $@

# ---- objects ---------------------------------------------------------------
$(BUILD)/obj/%_avx2.o:   XFLAGS += $(AVX2_FLAGS)
$(BUILD)/obj/%_avx512.o: XFLAGS += $(AVX512_FLAGS)

$(BUILD)/obj/%.o: %.c | $(PROTO_GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(ALL_CFLAGS) -c $< -o $@

$(INTERNAL_A): $(ROPE_OBJ) $(CACHE_OBJ) $(PROTO_OBJ) $(DAEMON_OBJ) $(CLIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CLIENT_A): $(CLIB_OBJ) $(PROTO_OBJ) $(ROPE_OBJ)
	rm -f $@ && ar rcs $@ $^

$(CLIENT_SO): $(CLIB_OBJ) $(PROTO_OBJ) $(ROPE_OBJ)
	$(CC) -shared $(LDFLAGS_ALL) -o $@ $^ -lprotobuf-c -lcjson -lm -lpthread

$(KVROPED): $(BUILD)/obj/daemon/main.o $(INTERNAL_A)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

$(KVROPE): $(CLI_OBJ) $(INTERNAL_A)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

$(BUILD)/tests/%: $(BUILD)/obj/tests/unit/%.o $(THELP_OBJ) $(INTERNAL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LIBS) $(MALLOC_LIB)

$(BUILD)/bench/%: $(BUILD)/obj/tests/bench/%.o $(THELP_OBJ) $(INTERNAL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LIBS) $(MALLOC_LIB)

# ---- running ---------------------------------------------------------------
run: deps
	@$(MAKE) --no-print-directory $(KVROPED) $(KVROPE)
	@scripts/run-daemon.sh $(KVROPED)

test: deps
	@$(MAKE) --no-print-directory all
	@KVR_BUILD=$(abspath $(BUILD)) KVR_VECTORS=$(SHARED)/vectors PYTHON=$(PYTHON) \
	  scripts/run-tests.sh

check: deps
	@$(MAKE) --no-print-directory BUILD=build/check MODE=check all
	@KVR_BUILD=$(abspath build/check) KVR_VECTORS=$(SHARED)/vectors KVR_SANITIZE=1 \
	  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  scripts/run-tests.sh --c-only

bench: deps-bench
	@$(MAKE) --no-print-directory all
	@KVR_BUILD=$(abspath $(BUILD)) KVR_VECTORS=$(SHARED)/vectors scripts/run-bench.sh

fuzz: deps
	@scripts/run-fuzz.sh

# Every exported symbol of the client library carries the kvr_ prefix.
check-symbols: $(CLIENT_SO)
	@bad=$$(nm -D --defined-only $(CLIENT_SO) | awk '$$2 ~ /[TDB]/ {print $$3}' | \
	  grep -v -E '^(kvr_|kvrope__|_init$$|_fini$$|_edata$$|_end$$|__bss_start$$)' || true); \
	if [ -n "$$bad" ]; then echo "unprefixed exports:"; echo "$$bad"; exit 1; fi; \
	echo "check-symbols: ok"

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
