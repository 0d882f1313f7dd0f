/*
 * kvt.h — the tests' shared fixtures that need nothing of kvrope itself:
 * temporary directories, removing them, deterministic bytes, whole files.
 * Compiled once into libtestcommon.a (tests/common/kvt.c), which every test
 * binary links. Helpers fail the calling Criterion test (cr_assert) rather
 * than return errors: a fixture that cannot be set up is a failed test.
 */
#ifndef KVR_TESTS_KVT_H
#define KVR_TESTS_KVT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

/* Makes a fresh directory $TMPDIR/<name>-XXXXXX (/tmp without TMPDIR) in
 * buf (cap bytes). */
void kvt_tmpdir(char *buf, size_t cap, const char *name);

/* Removes dir and everything below it (no error if it is gone). In
 * kvt_io.c, which needs no Criterion: benches may call it. */
void kvt_rmrf(const char *dir);

/* n bytes of a xorshift64 stream from seed: the same seed, the same bytes. */
void kvt_fill(uint8_t *p, size_t n, uint64_t seed);

/* t[i] = base + i for i < n: token ids in a run. */
void kvt_iota(uint32_t *t, size_t n, uint32_t base);

/* Writes n bytes to path (created or truncated). */
void kvt_write_file(const char *path, const void *data, size_t n);

/* The whole of path in a malloc'd buffer (NUL-terminated past *n; the
 * caller frees it). */
void *kvt_read_file(const char *path, size_t *n);

/* Like kvt_read_file, but NULL (nothing asserted) if path cannot be
 * opened: for inputs a test looks for. len may be NULL. */
char *kvt_slurp(const char *path, size_t *len);

/* The shared test vectors: $KVR_VECTORS, else ../shared/vectors. */
const char *kvt_vectors_dir(void);

/* Bit-equal floats, any NaN matching any NaN (a NaN's payload depends on
 * the operand order the compiler chose, so it is no part of a contract). */
bool kvt_same_f32(float a, float b);

/* The same for f16 bit patterns. */
bool kvt_same_f16(uint16_t a, uint16_t b);

/* The buffers of iov[0..niov), in order, copied to dst; how many bytes. */
size_t kvt_gather(void *dst, const struct iovec *iov, size_t niov);

/* FNV-1a of n bytes at p, continuing from h (start: 14695981039346656037). */
uint64_t kvt_fnv(uint64_t h, const void *p, size_t n);

/* How many descriptors process pid has open (its /proc/PID/fd entries,
 * "." and ".." included: compare counts, not absolute numbers). */
int kvt_count_fds(pid_t pid);

/* A connected Unix stream socket to path (asserted; close-on-exec), with a
 * receive timeout of rcv_timeout_s seconds if that is > 0. */
int kvt_unix_connect(const char *path, int rcv_timeout_s);

/* sendmsg of len bytes of buf on fd with `copies` copies (0..253) of
 * descriptor pass attached (SCM_RIGHTS): what sendmsg returned. */
ssize_t kvt_send_fds(int fd, const void *buf, size_t len, int pass, int copies);

/* A TCP port on 127.0.0.1 that was free a moment ago (bound, then let go). */
int kvt_free_tcp_port(void);

#endif
