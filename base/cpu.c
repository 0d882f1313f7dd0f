/*
 * cpu.c — which SIMD kernels this CPU can run (base/cpu.h): AVX-512
 * (F/BW/VL/DQ + FMA + AVX2), AVX2 + FMA + F16C, or the scalar reference,
 * found once with cpuid and kept. The shipped binary runs on any x86-64:
 * every kernel set is compiled for its ISA in files of its own and chosen
 * here at run time.
 */
#include <pthread.h>
#include <stdbool.h>
#include <cpuid.h>

#include "base/cpu.h"
#include "base/base_internal.h"

/* F16C through CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports
 * does not know the "f16c" feature string. */
static bool have_f16c(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return false;
    return (c & bit_F16C) != 0;
}

static kvr_isa detect_isa(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2"))
        return KVR_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && have_f16c())
        return KVR_ISA_AVX2;
    return KVR_ISA_SCALAR;
}

static pthread_once_t isa_once = PTHREAD_ONCE_INIT;
static kvr_isa isa_best = KVR_ISA_SCALAR;
static void isa_init(void) { isa_best = detect_isa(); }

kvr_isa kvr_isa_best(void)
{
    pthread_once(&isa_once, isa_init);
    return isa_best;
}

const char *kvr_isa_name(kvr_isa isa)
{
    switch (isa) {
    case KVR_ISA_AUTO:   return "auto";
    case KVR_ISA_SCALAR: return "scalar";
    case KVR_ISA_AVX2:   return "avx2";
    case KVR_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

kvr_isa kvr__isa_resolve(kvr_isa want)
{
    kvr_isa best = kvr_isa_best();
    if (want == KVR_ISA_AUTO) return best;
    if (want == KVR_ISA_SCALAR) return KVR_ISA_SCALAR;
    /* A forced ISA the CPU lacks degrades to the best it has (never faults). */
    if (want == KVR_ISA_AVX512) return best;
    if (want == KVR_ISA_AVX2) return best == KVR_ISA_SCALAR ? KVR_ISA_SCALAR : KVR_ISA_AVX2;
    return best;
}
