/*
 * test_daemon_config.c — kvroped's options without starting a daemon:
 * sizes, flags (both spellings), the config file and its precedence, the
 * cross-option rules, and that --help names every flag.
 */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/daemon.h"

Test(daemon_config, sizes)
{
    uint64_t v;
    cr_assert_eq(kvr_parse_size("4G", &v), 0);
    cr_assert_eq(v, 4ull << 30);
    cr_assert_eq(kvr_parse_size("512M", &v), 0);
    cr_assert_eq(v, 512ull << 20);
    cr_assert_eq(kvr_parse_size("64k", &v), 0);
    cr_assert_eq(v, 64ull << 10);
    cr_assert_eq(kvr_parse_size("1GiB", &v), 0);
    cr_assert_eq(v, 1ull << 30);
    cr_assert_eq(kvr_parse_size("12345", &v), 0);
    cr_assert_eq(v, 12345);
    cr_assert_lt(kvr_parse_size("", &v), 0);
    cr_assert_lt(kvr_parse_size("-1", &v), 0);
    cr_assert_lt(kvr_parse_size("4X", &v), 0);
    cr_assert_lt(kvr_parse_size("99999999999999999999", &v), 0);
    cr_assert_lt(kvr_parse_size("17179869184G", &v), 0);   /* overflows */
}

static int parse(kvr_daemon_config *c, const char **args, int n)
{
    char *argv[32];
    argv[0] = "kvroped";
    for (int i = 0; i < n; i++)
        argv[i + 1] = (char *)(uintptr_t)args[i];
    FILE *null = fopen("/dev/null", "w");
    int rc = kvr_daemon_config_parse_args(c, n + 1, argv, null, null);
    fclose(null);
    return rc;
}

/* parse on a freshly initialised *c. */
static int parse_fresh(kvr_daemon_config *c, const char **argv, int argc)
{
    kvr_daemon_config_init(c);
    return parse(c, argv, argc);
}

Test(daemon_config, defaults_and_flags)
{
    kvr_daemon_config c;
    kvr_daemon_config_init(&c);
    cr_assert_leq(c.max_memory, 4ull << 30);
    cr_assert_eq(c.max_frame, 1u << 20);
    cr_assert_eq(c.log_level, KVR_LOG_INFO);
    const char *a[] = { "--socket", "/tmp/x.sock", "--max-memory=512M", "--max-frame", "4096",
                        "--log-level", "debug", "--block-tokens", "32", "--max-connections", "5" };
    cr_assert_eq(parse(&c, a, 11), 0);
    cr_assert_str_eq(c.socket_path, "/tmp/x.sock");
    cr_assert_eq(c.max_memory, 512ull << 20);
    cr_assert_eq(c.max_frame, 4096);
    cr_assert_eq(c.log_level, KVR_LOG_DEBUG);
    cr_assert_eq(c.block_tokens, 32);
    cr_assert_eq(c.max_connections, 5);
}

Test(daemon_config, refusals)
{
    kvr_daemon_config c;
    const char *a1[] = { "--bogus", "1" };
    cr_assert_lt(parse_fresh(&c, a1, 2), 0);
    const char *a2[] = { "--max-memory" };
    cr_assert_lt(parse(&c, a2, 1), 0);
    const char *a3[] = { "--log-level", "loud" };
    cr_assert_lt(parse(&c, a3, 2), 0);
    const char *a4[] = { "--listen", "0.0.0.0:7420" };
    cr_assert_lt(parse(&c, a4, 2), 0);   /* non-loopback without a token */
    const char *a5[] = { "--listen", "0.0.0.0:7420", "--auth-token-file", "/tmp/t" };
    cr_assert_eq(parse_fresh(&c, a5, 4), 0);
    const char *a6[] = { "--listen", "127.0.0.1:7420" };
    cr_assert_eq(parse_fresh(&c, a6, 2), 0);
    const char *a7[] = { "--listen", "[::1]:7420" };
    cr_assert_eq(parse_fresh(&c, a7, 2), 0);
    const char *a8[] = { "--listen", "nocolon" };
    cr_assert_lt(parse(&c, a8, 2), 0);
    const char *a9[] = { "--socket", "none" };
    cr_assert_lt(parse_fresh(&c, a9, 2), 0);   /* nothing to listen on */
    const char *a10[] = { "stray" };
    cr_assert_lt(parse(&c, a10, 1), 0);
    /* Unpacking a message takes up to ~20x its size: 64 MiB at most. */
    const char *a11[] = { "--max-frame", "128M" };
    cr_assert_lt(parse_fresh(&c, a11, 2), 0);
    const char *a12[] = { "--max-frame", "64M" };
    cr_assert_eq(parse(&c, a12, 2), 0);
}

Test(daemon_config, file_then_flags)
{
    char path[] = "/tmp/kvr-conf-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    const char *text = "# kvroped config\n"
                       "socket = /tmp/from-file.sock\n"
                       "max-memory = 1G   # a comment\n"
                       "\n"
                       "log-level = warn\n";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    kvr_daemon_config c;
    const char *a[] = { "--max-memory", "2G", "--config", path };
    cr_assert_eq(parse_fresh(&c, a, 4), 0);
    cr_assert_str_eq(c.socket_path, "/tmp/from-file.sock");
    cr_assert_eq(c.max_memory, 2ull << 30);   /* the flag wins */
    cr_assert_eq(c.log_level, KVR_LOG_WARN);

    FILE *f = fopen(path, "w");
    fputs("max-memory 1G\n", f);
    fclose(f);
    const char *b[] = { "--config", path };
    cr_assert_lt(parse_fresh(&c, b, 2), 0);
    f = fopen(path, "w");
    fputs("no-such-option = 1\n", f);
    fclose(f);
    cr_assert_lt(parse(&c, b, 2), 0);
    unlink(path);
    const char *m[] = { "--config", "/nonexistent/kvroped.conf" };
    cr_assert_lt(parse(&c, m, 2), 0);
}

Test(daemon_config, help_names_every_flag)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    kvr_daemon_print_help(f);
    fclose(f);
    const char *flags[] = { "--socket", "--listen", "--auth-token-file", "--max-memory",
                            "--max-connections", "--max-frame", "--max-conn-buffer",
                            "--max-drain", "--block-tokens", "--threads", "--log-level",
                            "--config", "--help", "--version", "Examples" };
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        cr_assert_not_null(strstr(buf, flags[i]), "--help lacks %s", flags[i]);
    free(buf);
    kvr_daemon_config c;
    const char *h[] = { "--help" };
    cr_assert_eq(parse_fresh(&c, h, 1), 1);
    const char *v[] = { "--version" };
    cr_assert_eq(parse(&c, v, 1), 1);
}

Test(daemon_config, default_socket_path)
{
    char buf[256];
    setenv("XDG_RUNTIME_DIR", "/run/user/1234", 1);
    kvr_daemon_default_socket(buf, sizeof buf);
    cr_assert_str_eq(buf, "/run/user/1234/kvrope/kvroped.sock");
    unsetenv("XDG_RUNTIME_DIR");
    kvr_daemon_default_socket(buf, sizeof buf);
    if (geteuid() == 0)
        cr_assert_str_eq(buf, "/run/kvrope/kvroped.sock");
    else
        cr_assert_not_null(strstr(buf, "/tmp/kvrope-"));
}

/* Loads text (len bytes, NULs allowed) as a config file; the error in *e. */
static int load_text(const char *text, size_t len, kvr_daemon_config *c, kvr_error *e)
{
    char path[] = "/tmp/kvr-conf-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, len), (ssize_t)len);
    close(fd);
    kvr_daemon_config_init(c);
    memset(e, 0, sizeof *e);
    int rc = kvr_daemon_config_load_file(c, path, e);
    unlink(path);
    return rc;
}

/* Issue 29 item 9: a NUL byte cut a value short silently, a key set twice
 * took the last silently, and any size up to 2^64-1 was accepted. */
Test(daemon_config, file_refuses_nul_duplicates_and_huge_sizes)
{
    kvr_daemon_config c;
    kvr_error e;
    static const char nul[] = "log-level = warn\nsocket = /tmp/a.sock\0/evil\nmax-memory = 1G\n";
    cr_assert_lt(load_text(nul, sizeof nul - 1, &c, &e), 0);
    cr_assert(strstr(e.msg, ":2:") && strstr(e.msg, "NUL"), "%s", e.msg);

    const char *dup = "max-memory = 1G\nlog-level = warn\n# later\nmax-memory = 2G\n";
    cr_assert_lt(load_text(dup, strlen(dup), &c, &e), 0);
    cr_assert(strstr(e.msg, ":4:") && strstr(e.msg, "'max-memory'") &&
              strstr(e.msg, "first on line 1"), "%s", e.msg);
    const char *ok = "max-memory = 1G\nlog-level = warn\n";
    cr_assert_eq(load_text(ok, strlen(ok), &c, &e), 0, "%s", e.msg);
    cr_assert_eq(c.max_memory, 1ull << 30);

    const char *huge[] = {
        "max-memory = 18446744073709551615\n", "max-memory = 2P\n", "max-memory = 1048577G\n",
        "max-conn-buffer = 18446744073709551615\n", "max-drain = 18446744073709551615\n",
        "max-region-bytes = 16777216T\n", "disk-max = 18446744073709551615\n",
        "min-rate = 18446744073709551615\n", "max-msg-buffers = 18446744073709551615\n",
        "max-memory = 18446744073709551616\n", "max-memory = 1000\n",
    };
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        cr_assert_lt(load_text(huge[i], strlen(huge[i]), &c, &e), 0, "accepted: %s", huge[i]);
        cr_assert(strstr(e.msg, ":1:"), "%s", e.msg);
    }
    const char *range = "max-memory = 18446744073709551615\n";
    cr_assert_lt(load_text(range, strlen(range), &c, &e), 0);
    cr_assert(strstr(e.msg, "out of range"), "%s", e.msg);
    const char *edge = "max-memory = 1024T\ndisk-max = 1024T\n";
    cr_assert_eq(load_text(edge, strlen(edge), &c, &e), 0, "%s", e.msg);
    /* and on the command line */
    const char *a[] = { "--max-memory", "18446744073709551615" };
    cr_assert_lt(parse_fresh(&c, a, 2), 0);
}
