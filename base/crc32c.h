/*
 * crc32c.h — CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the
 * checksum of every disk-tier record and extent (cache/disk.c, cache/tier.c)
 * and of every block the cluster tier publishes (daemon/remote.c).
 * kvr_crc32c picks the SSE4.2 instruction at run time where the CPU has it
 * (three lanes), else slicing-by-8 tables; both give the same value for the
 * same bytes, and a checksum may be continued across pieces:
 *   kvr_crc32c(kvr_crc32c(0, a, n), b, m) == kvr_crc32c(0, a||b, n + m).
 * kvr_crc32c(0, "123456789", 9) == 0xE3069283. Thread-safe.
 */
#ifndef KVR_BASE_CRC32C_H
#define KVR_BASE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Not installed: hidden in shared objects (libkvrope.so exports its
 * installed headers' functions only), linked statically across rooms. */
#pragma GCC visibility push(hidden)

/* crc starts at 0 (or is a previous call's result, to continue). */
uint32_t kvr_crc32c(uint32_t crc, const void *p, size_t n);
/* The table implementation alone (tests compare the two). */
uint32_t kvr_crc32c_portable(uint32_t crc, const void *p, size_t n);

#pragma GCC visibility pop

#endif /* KVR_BASE_CRC32C_H */
