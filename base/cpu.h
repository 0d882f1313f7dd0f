/*
 * cpu.h — the SIMD kernel sets the project has and which one this CPU runs
 * (base/cpu.c). Every kernel family (conversions here in base/, RoPE rows in
 * rope/, codecs in cache/) has a scalar reference and AVX2 / AVX-512 versions
 * that produce the same bits; callers may force a set (tests, benchmarks),
 * and a forced set the CPU lacks degrades to the best it has. Part of the
 * installed API (through rope/rope.h).
 */
#ifndef KVR_BASE_CPU_H
#define KVR_BASE_CPU_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvr_isa {
    KVR_ISA_AUTO   = 0,   /* best the CPU supports */
    KVR_ISA_SCALAR = 1,   /* the reference */
    KVR_ISA_AVX2   = 2,   /* AVX2 + FMA + F16C */
    KVR_ISA_AVX512 = 3,
} kvr_isa;

kvr_isa     kvr_isa_best(void);                     /* what AUTO resolves to */
const char *kvr_isa_name(kvr_isa isa);

#ifdef __cplusplus
}
#endif
#endif /* KVR_BASE_CPU_H */
