/*
 * test_daemon_start.c — kvroped's start-up errors are reported with the code
 * and words of what failed. The binary is linked with
 * -Wl,--wrap=kvr_mem_malloc (Makefile), so a test can make exactly one kind
 * of allocation fail: here the one that holds the auth token, which used to
 * come back as -ENOMEM and be printed as "model fingerprint mismatch" (the
 * KVR_E* code that -ENOMEM collided with).
 */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/daemon_internal.h"
#include "tests/common/kvt_inproc.h"

void *__real_kvr_mem_malloc(size_t n);
void *__wrap_kvr_mem_malloc(size_t n);

/* Allocations of exactly this many bytes fail (0: none). */
static size_t fail_size;

void *__wrap_kvr_mem_malloc(size_t n)
{
    if (fail_size && n == fail_size)
        return NULL;
    return __real_kvr_mem_malloc(n);
}

/* A token of an odd length nothing else in start-up allocates. */
#define TOKEN_LEN 3917

static void token_file(char *path, size_t cap)
{
    snprintf(path, cap, "/tmp/kvr_start_token_XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    char buf[TOKEN_LEN];
    memset(buf, 'k', sizeof buf);
    cr_assert_eq(write(fd, buf, sizeof buf), (ssize_t)sizeof buf);
    close(fd);
}

static void config(kvr_daemon_config *cfg, const char *token_path)
{
    kvt_inproc_config(cfg);
    snprintf(cfg->auth_token_file, sizeof cfg->auth_token_file, "%s", token_path);
}

Test(daemon_start, token_allocation_failure_says_out_of_memory)
{
    char path[64];
    token_file(path, sizeof path);
    kvr_daemon_config cfg;
    config(&cfg, path);
    kvr_error err = { 0 };
    kvr_daemon *d = NULL;

    fail_size = TOKEN_LEN;
    int rc = kvr_daemon_create(&d, &cfg, &err);
    fail_size = 0;
    cr_assert_eq(rc, KVR_ENOMEM, "rc %d (%s): %s", rc, kvr_error_name(rc), err.msg);
    cr_assert_eq(err.code, KVR_ENOMEM);
    cr_assert(strstr(err.msg, "out of memory") && strstr(err.msg, path), "%s", err.msg);
    cr_assert_null(strstr(err.msg, "fingerprint"), "%s", err.msg);
    cr_assert_null(strstr(kvr_strerror(rc), "fingerprint"));
    cr_assert_null(d);

    /* Without the failure the same configuration starts. */
    rc = kvr_daemon_create(&d, &cfg, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);
    kvr_daemon_destroy(d);
    unlink(path);
}

Test(daemon_start, system_errors_carry_strerror_text)
{
    kvr_daemon_config cfg;
    config(&cfg, "/nonexistent/kvr/token");
    kvr_error err = { 0 };
    kvr_daemon *d = NULL;
    int rc = kvr_daemon_create(&d, &cfg, &err);
    cr_assert_eq(rc, KVR_EIO, "rc %d (%s)", rc, kvr_error_name(rc));
    cr_assert(strstr(err.msg, "/nonexistent/kvr/token") && strstr(err.msg, "No such file"),
              "%s", err.msg);

    kvr_daemon_config_init(&cfg);
    cr_assert_eq(kvr_daemon_config_load_file(&cfg, "/nonexistent/kvroped.conf", &err), KVR_EIO);
    cr_assert(strstr(err.msg, "No such file"), "%s", err.msg);
    cr_assert_eq(kvr_daemon_config_set(&cfg, "max-memory", "lots", &err), KVR_EINVAL);
    cr_assert_eq(err.code, KVR_EINVAL);
    cr_assert(strstr(err.msg, "max-memory"), "%s", err.msg);
}
