/*
 * test_int_install.c — `make install` as a packager runs it: into a
 * temporary DESTDIR, then a program built with `pkg-config --cflags --libs
 * kvrope` against the staged tree runs and talks to a daemon; libkvrope's
 * SONAME link, headers, man pages (groff without warnings), the units
 * (`systemd-analyze verify`), the example config (`--check-config`), a
 * program that includes kvrope_llama.h, the Python package imported by
 * Debian's python3 from the staged tree; and `make uninstall` leaves
 * nothing behind.
 *
 * Runs make in the source tree (the working directory, or $KVR_SRC) with
 * BUILD set to $KVR_BUILD and INSTALL_DEPS empty, so it installs the
 * binaries under test and never builds (not even when sources changed).
 */
#include <criterion/criterion.h>
#include <sys/stat.h>

#include "daemon/daemon.h"
#include "tests/common/kvr_opsd.h"

static char g_tmp[256];
static char g_src[1024];

static void setup(void)
{
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kvr-install-XXXXXX");
    cr_assert(mkdtemp(g_tmp));
    const char *s = getenv("KVR_SRC");
    if (s && *s)
        snprintf(g_src, sizeof g_src, "%s", s);
    else
        cr_assert(getcwd(g_src, sizeof g_src));
    char mk[1100];
    snprintf(mk, sizeof mk, "%s/dist/kvrope.pc.in", g_src);
    struct stat st;
    cr_assert_eq(stat(mk, &st), 0, "run from the source tree (or set KVR_SRC): %s", mk);
}

static void teardown(void)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (g_tmp[0] && system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", g_tmp);
}

TestSuite(install, .init = setup, .fini = teardown, .timeout = 600);

/* Runs a shell command, output into out; returns its exit status. */
static int sh(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sh(char *out, size_t cap, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[8300];
    snprintf(full, sizeof full, "( %s ) 2>&1", cmd);
    FILE *p = popen(full, "r");
    cr_assert(p);
    size_t n = 0;
    if (out && cap) {
        n = fread(out, 1, cap - 1, p);
        out[n] = 0;
    } else {
        char sink[4096];
        while (fread(sink, 1, sizeof sink, p) > 0) {
        }
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* make -C SRC TARGET with the build under test; extra: more variables. */
static int make(char *out, size_t cap, const char *target, const char *extra)
{
    const char *b = testd_build_dir();
    char build[1100];
    size_t sl = strlen(g_src);
    if (!strncmp(b, g_src, sl) && b[sl] == '/')
        snprintf(build, sizeof build, "%s", b + sl + 1);   /* relative: the .d files match */
    else
        snprintf(build, sizeof build, "%s", b);
    const char *san = getenv("KVR_SANITIZE");
    return sh(out, cap, "make --no-print-directory -C '%s' %s BUILD='%s' INSTALL_DEPS= %s %s",
              g_src, target,
              build, san && *san == '1' ? "MODE=check" : "", extra);
}

static bool exists(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool exists(const char *fmt, ...)
{
    char p[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p, sizeof p, fmt, ap);
    va_end(ap);
    struct stat st;
    return lstat(p, &st) == 0;
}

static const char PROG[] =
    "#include <kvrope.h>\n"
    "#include <stdio.h>\n"
    "int main(int argc, char **argv)\n"
    "{\n"
    "    kvr_rope_config rc;\n"
    "    kvr_rope_config_init(&rc);            /* rope/rope.h, through kvrope.h */\n"
    "    kvr_client *c;\n"
    "    if (argc < 2 || kvr_client_connect(&c, argv[1], NULL) != 0) {\n"
    "        fprintf(stderr, \"connect: %s\\n\", kvr_client_last_error(NULL));\n"
    "        return 1;\n"
    "    }\n"
    "    int r = kvr_client_ping(c, NULL);\n"
    "    kvr_client_close(c);\n"
    "    printf(\"ping %d theta %g\\n\", r, rc.theta);\n"
    "    return r == 0 ? 0 : 1;\n"
    "}\n";

/* The llama.cpp bridge's header, installed as kvrope/kvrope_llama.h. */
static const char PROG_LLAMA[] =
    "#include <kvrope_llama.h>\n"
    "#include <stdio.h>\n"
    "int main(void)\n"
    "{\n"
    "    kvr_llama_type t;\n"
    "    if (kvr_llama_type_parse(\"q8_0\", &t) != 0)\n"
    "        return 1;\n"
    "    kvr_client *c = NULL;   /* kvrope.h's API, through kvrope_llama.h */\n"
    "    kvr_client_close(c);\n"
    "    printf(\"llama type %s\\n\", kvr_llama_type_name(t));\n"
    "    return 0;\n"
    "}\n";

Test(install, destdir_install_pkg_config_program_runs_then_uninstall)
{
    static char out[1 << 16];
    char dest[400];
    snprintf(dest, sizeof dest, "%s/stage", g_tmp);
    char vars[600];
    snprintf(vars, sizeof vars, "PREFIX=/usr/local DESTDIR='%s'", dest);
    int rc = make(out, sizeof out, "install", vars);
    cr_assert_eq(rc, 0, "make install: %s", out);
    cr_assert(!strstr(out, " -c ") && !strstr(out, "-o build"), "install built something:\n%s", out);

    const char *p = "/usr/local";
    cr_assert(exists("%s%s/bin/kvroped", dest, p));
    cr_assert(exists("%s%s/bin/kvrope", dest, p));
    cr_assert(exists("%s%s/lib/libkvrope.so", dest, p));
    cr_assert(exists("%s%s/lib/libkvrope.a", dest, p));
    cr_assert(exists("%s%s/include/kvrope/kvrope.h", dest, p));
    cr_assert(exists("%s%s/include/kvrope/rope/rope.h", dest, p));
    cr_assert(exists("%s%s/include/kvrope/base/error.h", dest, p));
    cr_assert(exists("%s%s/include/kvrope/kvrope_llama.h", dest, p));
    cr_assert(exists("%s%s/include/kvrope/client/kvrope.h", dest, p));
    cr_assert(exists("%s%s/lib/pkgconfig/kvrope.pc", dest, p));
    cr_assert(exists("%s%s/share/man/man8/kvroped.8", dest, p));
    cr_assert(exists("%s%s/share/man/man1/kvrope.1", dest, p));
    cr_assert(exists("%s%s/lib/systemd/system/kvroped.service", dest, p));
    cr_assert(exists("%s%s/lib/systemd/system/kvroped.socket", dest, p));
    cr_assert(exists("%s%s/lib/systemd/system/kvroped-metrics.socket", dest, p));
    cr_assert(exists("%s%s/lib/sysusers.d/kvrope.conf", dest, p));
    cr_assert(exists("%s%s/etc/kvrope/kvroped.conf", dest, p));
    cr_assert(exists("%s%s/share/doc/kvrope/kvroped.conf.example", dest, p));
    cr_assert(exists("%s%s/share/doc/kvrope/operations.md", dest, p));

    /* The SONAME, if the library has one, is a link to the installed file. */
    char soname[256] = "";
    rc = sh(out, sizeof out, "objdump -p '%s%s/lib/libkvrope.so' | awk '$1 == \"SONAME\" {print $2}'",
            dest, p);
    cr_assert_eq(rc, 0, "%s", out);
    sscanf(out, "%255s", soname);
    if (soname[0]) {
        cr_assert(exists("%s%s/lib/%s", dest, p, soname), "no %s link", soname);
        rc = sh(out, sizeof out, "test -e '%s%s/lib/%s'", dest, p, soname);
        cr_assert_eq(rc, 0, "%s dangles", soname);
    }

    /* The units name the installed paths. */
    rc = sh(out, sizeof out, "cat '%s%s/lib/systemd/system/kvroped.service'", dest, p);
    cr_assert(strstr(out, "ExecStart=/usr/local/bin/kvroped --config /usr/local/etc/kvrope/kvroped.conf"),
              "%s", out);
    cr_assert(strstr(out, "Type=notify") && strstr(out, "NoNewPrivileges=yes") &&
              strstr(out, "ProtectSystem=strict") && strstr(out, "PrivateTmp=yes") &&
              strstr(out, "StateDirectory=kvrope") && strstr(out, "RuntimeDirectory=kvrope"),
              "%s", out);

    /* A program built with pkg-config against the staged tree runs. */
    char prog_c[400], prog[400];
    snprintf(prog_c, sizeof prog_c, "%s/prog.c", g_tmp);
    snprintf(prog, sizeof prog, "%s/prog", g_tmp);
    cr_assert_eq(opsd_write_file(prog_c, PROG, 0644), 0);
    const char *san = getenv("KVR_SANITIZE");
    const char *sanflags = san && *san == '1' ? "-fsanitize=address,undefined" : "";
    rc = sh(out, sizeof out,
            "export PKG_CONFIG_PATH='%s%s/lib/pkgconfig' PKG_CONFIG_SYSROOT_DIR='%s'; "
            "pkg-config --exists kvrope && pkg-config --modversion kvrope && "
            "cc -std=c11 -Wall -Werror %s '%s' $(pkg-config --cflags --libs kvrope) -o '%s' && "
            "pkg-config --cflags --libs kvrope", dest, p, dest, sanflags, prog_c, prog);
    cr_assert_eq(rc, 0, "pkg-config build: %s", out);
    cr_assert(strstr(out, "-I") && strstr(out, dest), "flags point into DESTDIR: %s", out);
    /* Static linking against libkvrope.a with --static works too. */
    char sprog[420];
    snprintf(sprog, sizeof sprog, "%s-static", prog);
    rc = sh(out, sizeof out,
            "export PKG_CONFIG_PATH='%s%s/lib/pkgconfig' PKG_CONFIG_SYSROOT_DIR='%s'; "
            "cc -std=c11 %s '%s' -Wl,-Bstatic -lkvrope -Wl,-Bdynamic "
            "$(pkg-config --cflags kvrope) $(pkg-config --static --libs-only-L kvrope) "
            "$(pkg-config --static --libs kvrope | sed 's/-lkvrope//') -o '%s'",
            dest, p, dest, sanflags, prog_c, sprog);
    cr_assert_eq(rc, 0, "static build: %s", out);
    kvr_testd d;
    cr_assert_eq(testd_start(&d, NULL), 0);
    rc = sh(out, sizeof out, "'%s' '%s' && LD_LIBRARY_PATH='%s%s/lib' '%s' '%s' && "
            "LD_LIBRARY_PATH='%s%s/lib' ldd '%s'", sprog, d.sock, dest, p, prog, d.sock,
            dest, p, prog);
    cr_assert_eq(rc, 0, "the program: %s", out);
    cr_assert(strstr(out, "ping 0 theta 10000"), "%s", out);

    /* A program that includes kvrope_llama.h builds with the same flags. */
    char lprog_c[400], lprog[400];
    snprintf(lprog_c, sizeof lprog_c, "%s/prog_llama.c", g_tmp);
    snprintf(lprog, sizeof lprog, "%s/prog_llama", g_tmp);
    cr_assert_eq(opsd_write_file(lprog_c, PROG_LLAMA, 0644), 0);
    rc = sh(out, sizeof out,
            "export PKG_CONFIG_PATH='%s%s/lib/pkgconfig' PKG_CONFIG_SYSROOT_DIR='%s'; "
            "cc -std=c11 -Wall -Werror %s '%s' $(pkg-config --cflags --libs kvrope) -o '%s' && "
            "LD_LIBRARY_PATH='%s%s/lib' '%s'", dest, p, dest, sanflags, lprog_c, lprog, dest, p,
            lprog);
    cr_assert_eq(rc, 0, "kvrope_llama.h program: %s", out);
    cr_assert(strstr(out, "llama type q8_0"), "%s", out);

    /* The Python package is where Debian's python3 looks under the prefix,
     * imports from there (not from the source tree), knows where libkvrope
     * was installed, and talks to the daemon through the staged library. */
    /* A sanitizer build's libkvrope needs its runtimes loaded first in python. */
    const char *pypre = *sanflags ? "LD_PRELOAD=\"$(cc -print-file-name=libasan.so) "
                                    "$(cc -print-file-name=libubsan.so)\" "
                                    "ASAN_OPTIONS=detect_leaks=0" : "";
    if (sh(NULL, 0, "test -x /usr/bin/python3 && /usr/bin/python3 -c 'import numpy'") == 0) {
        rc = sh(out, sizeof out,
                "cd / && site=$(ls -d '%s%s'/lib/python3*/dist-packages) && "
                "%s env -u PYTHONPATH PYTHONPATH=\"$site\" KVROPE_LIB='%s%s/lib/libkvrope.so' "
                "/usr/bin/python3 -c 'import kvrope, kvrope._install as i; "
                "print(kvrope.__file__); print(\"libdir\", i.LIBDIR); "
                "c = kvrope.connect(\"%s\"); print(\"pong\", c.ping() is not None); c.close()' && "
                "/usr/bin/python3 -c 'import sys; print(\"on sys.path:\", any(p.startswith(\"/usr/local/lib/python3\") and p.endswith(\"dist-packages\") for p in sys.path))'",
                dest, p, pypre, dest, p, d.sock);
        cr_assert_eq(rc, 0, "python import: %s", out);
        char want_py[600];
        snprintf(want_py, sizeof want_py, "%s%s/lib/python3", dest, p);
        cr_assert(strstr(out, want_py), "kvrope imported from the staged tree: %s", out);
        cr_assert(strstr(out, "libdir /usr/local/lib\n"), "%s", out);
        cr_assert(strstr(out, "pong True"), "%s", out);
        cr_assert(strstr(out, "on sys.path: True"), "Debian's python3 looks there: %s", out);
    }
    testd_stop(&d);
    char want[600];
    snprintf(want, sizeof want, "%s%s/lib/", dest, p);
    cr_assert(strstr(out, want), "libkvrope resolved from the staged tree: %s", out);

    /* The installed example config passes --check-config as shipped. */
    rc = sh(out, sizeof out, "'%s%s/bin/kvroped' --check-config '%s%s/etc/kvrope/kvroped.conf'",
            dest, p, dest, p);
    cr_assert_eq(rc, 0, "%s", out);

    /* Man pages: roff that groff formats without a warning. */
    if (sh(NULL, 0, "command -v groff") == 0) {
        for (int i = 0; i < 2; i++) {
            rc = sh(out, sizeof out, "groff -man -Tutf8 -ww -z '%s%s/share/man/%s'", dest, p,
                    i ? "man1/kvrope.1" : "man8/kvroped.8");
            cr_assert_eq(rc, 0, "%s", out);
            cr_assert_eq(out[0], 0, "groff warnings: %s", out);
        }
        rc = sh(out, sizeof out, "groff -man -Tascii -P-cbou '%s%s/share/man/man8/kvroped.8'", dest, p);
        cr_assert(strstr(out, "check-config") && strstr(out, "SIGHUP"), "%.400s", out);
        cr_assert(strstr(out, "kvrope " KVR_DAEMON_VERSION), "the version is filled in: %.400s", out);
    }

    /* A second install keeps an edited config. */
    rc = sh(out, sizeof out, "echo 'log-level = warn' >> '%s%s/etc/kvrope/kvroped.conf'", dest, p);
    rc = make(out, sizeof out, "install", vars);
    cr_assert_eq(rc, 0, "%s", out);
    rc = sh(out, sizeof out, "tail -1 '%s%s/etc/kvrope/kvroped.conf'", dest, p);
    cr_assert(strstr(out, "log-level = warn"), "the operator's config was overwritten");

    /* Uninstall: only the edited config is left. */
    rc = make(out, sizeof out, "uninstall", vars);
    cr_assert_eq(rc, 0, "make uninstall: %s", out);
    rc = sh(out, sizeof out, "cd '%s' && find . -type f -o -type l | sort", dest);
    cr_assert_eq(rc, 0);
    cr_assert_str_eq(out, "./usr/local/etc/kvrope/kvroped.conf\n", "left behind:\n%s", out);
}

Test(install, systemd_analyze_verifies_the_units)
{
    static char out[1 << 16];
    if (sh(out, sizeof out, "command -v systemd-analyze") != 0) {
        cr_skip_test("systemd-analyze is not installed (Debian package systemd): units not verified");
        return;
    }
    /* Can it run here at all? A trivial unit it must accept. */
    char probe[400];
    snprintf(probe, sizeof probe, "%s/kvr-probe.service", g_tmp);
    cr_assert_eq(opsd_write_file(probe, "[Unit]\nDescription=probe\n[Service]\nType=oneshot\n"
                                        "ExecStart=/bin/true\n", 0644), 0);
    if (sh(out, sizeof out, "systemd-analyze verify --man=no '%s'", probe) != 0) {
        cr_skip_test("systemd-analyze cannot run in this environment (%s): units not verified",
                     out);
        return;
    }
    /* Installed at a real prefix (no DESTDIR), so ExecStart exists. */
    char prefix[400], vars[600];
    snprintf(prefix, sizeof prefix, "%s/prefix", g_tmp);
    snprintf(vars, sizeof vars, "PREFIX='%s'", prefix);
    int rc = make(out, sizeof out, "install", vars);
    cr_assert_eq(rc, 0, "make install: %s", out);
    rc = sh(out, sizeof out, "cd '%s/lib/systemd/system' && systemd-analyze verify --man=no "
            "kvroped.service kvroped.socket kvroped-metrics.socket", prefix);
    cr_assert_eq(rc, 0, "systemd-analyze verify: %s", out);
    cr_assert(!strstr(out, "kvroped"), "systemd-analyze complained:\n%s", out);
    /* And it does catch a broken unit (the check is real). */
    rc = sh(out, sizeof out, "cd '%s/lib/systemd/system' && sed 's/^Type=notify/Type=notyfy/' "
            "kvroped.service > broken.service && systemd-analyze verify --man=no broken.service",
            prefix);
    cr_assert(strstr(out, "notyfy"), "a bad Type= went unnoticed: %s", out);
    make(out, sizeof out, "uninstall", vars);
}
