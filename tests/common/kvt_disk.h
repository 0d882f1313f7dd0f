/*
 * kvt_disk.h — fixtures for the disk tier's storage-layer tests
 * (cache/disk.h): open and recover a directory in one call, flip a byte of
 * a file. Compiled into libtestcommon.a (tests/common/kvt_disk.c); failures
 * are Criterion assertions in the calling test.
 */
#ifndef KVR_TESTS_KVT_DISK_H
#define KVR_TESTS_KVT_DISK_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/disk.h"

/* Opens cfg->dir and recovers it, asserting both succeed: each record goes
 * to on_record and each skipped range to on_corrupt (with arg; either may be
 * NULL), the summary to *rs (if not NULL). With ready, recovery is also
 * ended (kvr_disk_recover_done) and the disk takes writes; without, the
 * caller claims handles and ends it. */
kvr_disk *kvt_disk_open(const kvr_disk_config *cfg, kvr_disk_record_fn on_record,
                        kvr_disk_corrupt_fn on_corrupt, void *arg, kvr_disk_recovery *rs,
                        bool ready);

/* n buffers: data[i] gets sizes[i] bytes (malloc'd, or 4096-aligned with
 * aligned; the caller frees), filled with kvt_fill(seed + i), and b[i]
 * describes it. */
void kvt_disk_fill_bufs(size_t n, const size_t *sizes, uint64_t seed, bool aligned,
                        uint8_t **data, kvr_disk_buf *b);

/* The byte at off of path, xor mask, written back. */
void kvt_flip_byte(const char *path, uint64_t off, uint8_t mask);

/* Criterion tests suite::name_uring and suite::name_posix running fn on
 * io_uring and on the forced POSIX engine (the test files include
 * criterion.h). */
#define KVT_DISK_TESTS(suite, name, fn)                               \
    Test(suite, name##_uring) { fn(KVR_DISK_ENGINE_URING); }          \
    Test(suite, name##_posix) { fn(KVR_DISK_ENGINE_POSIX); }

/* Spills kb (one buffer; durable with sync) into h[0], h[1], ... until a
 * spill fails, asserted to come before cap were made and to fail with code
 * and a message naming needle (a full disk's refusal): how many were made. */
int kvt_spill_until_refused(kvr_disk *d, const kvr_disk_buf *kb, kvr_disk_handle *h, int cap,
                            bool sync, int code, const char *needle);

/* fn(e, dir) in a fresh temporary directory dir, removed afterwards. */
void kvt_disk_in_tmpdir(void (*fn)(kvr_disk_engine e, const char *dir), kvr_disk_engine e);

/* Defines the body that follows as static void name(e, dir), run by
 * suite::name_uring and suite::name_posix (kvt_disk_in_tmpdir) on each
 * engine in a fresh directory:
 *     KVT_DISK_TEST(disk_spill, round_trips)
 *     {
 *         kvr_disk *d = open_ready(dir, e, ...);
 */
#define KVT_DISK_TEST(suite, name)                                                  \
    static void name(kvr_disk_engine e, const char *dir);                           \
    Test(suite, name##_uring) { kvt_disk_in_tmpdir(name, KVR_DISK_ENGINE_URING); }  \
    Test(suite, name##_posix) { kvt_disk_in_tmpdir(name, KVR_DISK_ENGINE_POSIX); }  \
    static void name(kvr_disk_engine e, const char *dir)

#endif
