/*
 * fuzz_config.c — libFuzzer target for the daemon's config file
 * (kvr_daemon_config_load_file: "key = value" lines, comments, sizes,
 * durations, paths) followed by kvr_daemon_config_check, as kvroped
 * --config FILE runs them. The input is the file's bytes, handed over as
 * /proc/self/fd/N of a memfd (no temporary files).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemon/daemon.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int fd = -1;
    if (fd < 0 && (fd = memfd_create("kvr-fuzz-config", MFD_CLOEXEC)) < 0)
        abort();
    if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != (ssize_t)size)
        abort();
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    kvr_daemon_config c;
    kvr_daemon_config_init(&c);
    kvr_error err;
    if (kvr_daemon_config_load_file(&c, path, &err) == 0)
        (void)kvr_daemon_config_check(&c, &err);
    return 0;
}
