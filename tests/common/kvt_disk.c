/*
 * kvt_disk.c — tests/common/kvt_disk.h: open-and-recover, byte flips,
 * spilling until the disk is full.
 */
#include "tests/common/kvt_disk.h"
#include "tests/common/kvt.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

kvr_disk *kvt_disk_open(const kvr_disk_config *cfg, kvr_disk_record_fn on_record,
                        kvr_disk_corrupt_fn on_corrupt, void *arg, kvr_disk_recovery *rs,
                        bool ready)
{
    kvr_disk *d = NULL;
    kvr_error err = { 0 };
    cr_assert_eq(kvr_disk_open(&d, cfg, &err), 0, "%s", err.msg);
    cr_assert_eq(kvr_disk_recover(d, on_record, on_corrupt, arg, rs, &err), 0, "%s", err.msg);
    if (ready)
        cr_assert_eq(kvr_disk_recover_done(d, &err), 0, "%s", err.msg);
    return d;
}

void kvt_flip_byte(const char *path, uint64_t off, uint8_t mask)
{
    int fd = open(path, O_RDWR);
    cr_assert_geq(fd, 0, "%s", path);
    uint8_t c;
    cr_assert_eq(pread(fd, &c, 1, (off_t)off), 1, "%s", path);
    c ^= mask;
    cr_assert_eq(pwrite(fd, &c, 1, (off_t)off), 1, "%s", path);
    close(fd);
}

void kvt_disk_in_tmpdir(void (*fn)(kvr_disk_engine e, const char *dir), kvr_disk_engine e)
{
    char dir[256];
    kvt_tmpdir(dir, sizeof dir, "kvr_disk");
    fn(e, dir);
    kvt_rmrf(dir);
}

int kvt_spill_until_refused(kvr_disk *d, const kvr_disk_buf *kb, kvr_disk_handle *h, int cap,
                            bool sync, int code, const char *needle)
{
    kvr_error err = { 0 };
    int n = 0, rc = 0;
    while (n < cap && (rc = kvr_disk_spill(d, kb, 1, &h[n], sync, &err)) == 0)
        n++;
    cr_assert_eq(rc, code, "spill %d of at most %d: %s (want %s): %s", n, cap,
                 kvr_error_name(rc), kvr_error_name(code), err.msg);
    cr_assert(strstr(err.msg, needle), "spill %d refused: '%s' names '%s'", n, err.msg, needle);
    return n;
}

void kvt_disk_fill_bufs(size_t n, const size_t *sizes, uint64_t seed, bool aligned,
                        uint8_t **data, kvr_disk_buf *b)
{
    for (size_t i = 0; i < n; i++) {
        if (aligned)
            cr_assert_eq(posix_memalign((void **)&data[i], 4096, sizes[i]), 0);
        else
            cr_assert_not_null(data[i] = malloc(sizes[i]));
        kvt_fill(data[i], sizes[i], seed + (uint64_t)i);
        b[i] = (kvr_disk_buf){ .data = data[i], .len = sizes[i] };
    }
}
