# client/llama/llama.mk — the llama.cpp parts of the build, included by the
# top-level Makefile (after the source and archive lists, before `all`).
#
# The pinned release (llama.cpp v0.5.0 from npm: @node-llama-cpp/linux-x64@3.22.1
# for the libraries, node-llama-cpp@3.22.1 for the headers of the same tree) is
# fetched by scripts/llama-deps.sh into $(LLAMA_CACHE) when missing; the check
# runs once per top-level make (its result is exported to sub-makes). When the
# registry cannot be reached the build prints that one line and skips only the
# parts that need libllama; KVR_REQUIRE_LLAMA=1 (CI) turns that into an error.
#
# What it provides to rules (here or elsewhere):
#   LLAMA_OK      1 when headers and libraries are present, else empty
#   LLAMA_CFLAGS  include paths of exactly those headers (as system headers, so
#                 our warning set does not apply to them) and
#                 -DKVR_LLAMA_LIBDIR="<dir>" (for ggml_backend_load_all_from_path)
#                 and -DKVR_LLAMA_GEN_GGUF="<abs path of scripts/gen-gguf.py>"
#   LLAMA_LIBS    -L, rpath and -l:libllama.v0.5.0.so -l:libggml.v0.5.0.so -l:libggml-base.so
#   LLAMA_LIBDIR  the directory of those libraries (and the CPU backends)
#
# Sources, picked up by name:
#   client/llama/*.c but worker*.c  the bridge (no libllama): part of libkvrope
#                                   (CLIB_OBJ), so the CLI and every test link it
#   client/llama/worker*.c          build/kvrope-llama (needs libllama); all but
#                                   worker_main.c also as build/lib/libworker.a,
#                                   which the llama tests and benches link
#   tests/llama/test_*.c            Criterion binaries linked with libllama
#   tests/llama/bench_*.c           benchmarks linked with libllama
# Objects of the libllama parts get LLAMA_CFLAGS.

LLAMA_CACHE ?= build/llama
LLAMA_REL   := v0.5.0

ifeq ($(filter clean,$(MAKECMDGOALS)),)
  ifndef KVR_LLAMA_STATUS
    KVR_LLAMA_STATUS := $(shell scripts/llama-deps.sh $(LLAMA_CACHE))
    ifneq ($(KVR_LLAMA_STATUS),ok)
      $(info $(KVR_LLAMA_STATUS))
    endif
  endif
  export KVR_LLAMA_STATUS
endif

ifeq ($(KVR_LLAMA_STATUS),ok)
  LLAMA_OK := 1
else
  LLAMA_OK :=
  ifneq ($(KVR_REQUIRE_LLAMA),)
    ifeq ($(filter clean,$(MAKECMDGOALS)),)
      $(error KVR_REQUIRE_LLAMA is set but the llama.cpp parts cannot be built: $(KVR_LLAMA_STATUS))
    endif
  endif
endif

LLAMA_LIBDIR := $(abspath $(LLAMA_CACHE))/npm/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
LLAMA_INC    := $(abspath $(LLAMA_CACHE))/llama.cpp-$(LLAMA_REL)
LLAMA_CFLAGS := -isystem $(LLAMA_INC)/include -isystem $(LLAMA_INC)/ggml/include \
                -DKVR_LLAMA_LIBDIR='"$(LLAMA_LIBDIR)"' \
                -DKVR_LLAMA_GEN_GGUF='"$(abspath scripts/gen-gguf.py)"'
LLAMA_LIBS   := -L$(LLAMA_LIBDIR) -Wl,-rpath,$(LLAMA_LIBDIR) \
                -l:libllama.$(LLAMA_REL).so -l:libggml.$(LLAMA_REL).so -l:libggml-base.so

# ---- the bridge: plain C, always built, part of libkvrope -------------------
LLAMA_WORKER_SRC := $(wildcard client/llama/worker*.c)
LLAMA_BRIDGE_SRC := $(filter-out $(LLAMA_WORKER_SRC),$(wildcard client/llama/*.c))
CLIB_OBJ += $(call obj,$(LLAMA_BRIDGE_SRC))

# ---- the parts that need libllama ---------------------------------------------
LLAMA_TEST_SRC  := $(wildcard tests/llama/test_*.c)
LLAMA_BENCH_SRC := $(wildcard tests/llama/bench_*.c)
KVROPE_LLAMA    := $(BUILD)/kvrope-llama

$(BUILD)/obj/tests/llama/%.o:      XFLAGS += $(LLAMA_CFLAGS)
$(BUILD)/obj/client/llama/worker%.o: XFLAGS += $(LLAMA_CFLAGS)
# The llama benches' shared helper names scripts/gen-gguf.py (KVR_LLAMA_GEN_GGUF).
$(BUILD)/obj/tests/common/kvr_llama_bench.o: XFLAGS += $(LLAMA_CFLAGS)

ifeq ($(LLAMA_OK),1)
LLAMA_TESTS   := $(patsubst tests/llama/%.c,$(BUILD)/tests/%,$(LLAMA_TEST_SRC))
LLAMA_BENCHES := $(patsubst tests/llama/%.c,$(BUILD)/bench/%,$(LLAMA_BENCH_SRC))
TESTS   += $(LLAMA_TESTS)
BENCHES += $(LLAMA_BENCHES)

# The worker as a library (everything but its main): kvrope-llama, and the
# llama tests and benches that drive the engine in-process, link it.
WORKER_A := $(BUILD)/lib/libworker.a
$(WORKER_A): $(call obj,$(filter-out client/llama/worker_main.c,$(LLAMA_WORKER_SRC)))
	$(archive)

# The llama tests' engine helpers (tests/llama/llama_test.c) need llama.h:
# their own small archive, next to libtestcommon.a.
TESTLLAMA_A := $(BUILD)/lib/libtestllama.a
$(TESTLLAMA_A): $(BUILD)/obj/tests/llama/llama_test.o
	$(archive)

$(LLAMA_TESTS): $(BUILD)/tests/%: $(BUILD)/obj/tests/llama/%.o $(TESTLLAMA_A) $(TESTCOMMON_A) $(WORKER_A) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ -lcriterion $(LLAMA_LIBS) $(LIBS) $(MALLOC_LIB)

$(LLAMA_BENCHES): $(BUILD)/bench/%: $(BUILD)/obj/tests/llama/%.o $(TESTLLAMA_A) $(TESTCOMMON_A) $(WORKER_A) $(ALL_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LLAMA_LIBS) $(LIBS) $(MALLOC_LIB)

ifneq ($(LLAMA_WORKER_SRC),)
LLAMA_PROGS := $(KVROPE_LLAMA)
$(KVROPE_LLAMA): $(BUILD)/obj/client/llama/worker_main.o $(WORKER_A) $(ALL_A)
	$(CC) $(LDFLAGS_ALL) -o $@ $^ $(LLAMA_LIBS) $(LIBS) $(MALLOC_LIB)
endif
endif
