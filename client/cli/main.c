/*
 * main.c — the `kvrope` command-line tool: global options, then one
 * subcommand. `kvrope rope ...` is handed to the RoPE engine (cli_rope.c)
 * with argv[0] = "rope" and needs no daemon; every other subcommand talks to
 * kvroped through libkvrope (cli_cmd.c; the position-layout commands
 * assemble, group and retain in cli_layout.c).
 *
 * Options may appear anywhere after the subcommand too (`kvrope ls --json`);
 * `--name=value` and `--name value` are both accepted; `--` ends options.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/cli/cli.h"
#include "client/cli/cli_rope.h"

/* The rope subcommand lives in another engineer's file; until it is linked,
 * `kvrope rope` says so instead of the whole tool failing to link. */
#pragma weak kvr_cli_rope_main

static const char help_text[] =
"usage: kvrope [global options] COMMAND [args] [options]\n"
"\n"
"Talks to kvroped, the RoPE-aware KV-cache daemon.\n"
"\n"
"Global options:\n"
"  --socket PATH      Unix socket (default $KVROPE_SOCKET, else the daemon's default:\n"
"                     $XDG_RUNTIME_DIR/kvrope/kvroped.sock, /run/kvrope/kvroped.sock\n"
"                     as root, else /tmp/kvrope-$UID/kvroped.sock)\n"
"  --connect H:P      TCP instead ($KVROPE_CONNECT)\n"
"  --token-file FILE  shared-secret token for TCP ($KVROPE_TOKEN_FILE)\n"
"  --timeout MS       give up on a silent daemon after MS milliseconds\n"
"  --json             one JSON document on stdout (errors too: {\"error\": ...})\n"
"  --version          the version (kvrope --version)\n"
"  -h, --help         this help; kvrope COMMAND --help: that command's only\n"
"  -q, --quiet        no human-readable output on success\n"
"\n"
"Commands:\n"
"  ping                               daemon version and round-trip time\n"
"  stats                              daemon metrics\n"
"  models [list]                      registered models\n"
"  models rm NAME                     remove a model no context uses\n"
"  models add NAME --config config.json [--style neox|gptj] [--dtype f16]\n"
"  models add NAME --layers L --heads H --head-dim D [--theta T] [--rotary-dim R]\n"
"                                     [--style neox|gptj] [--dtype f16]\n"
"        [--codec SPEC]               default codec of its contexts at rest:\n"
"                                     f32|f16|bf16, int8|int4|int2[/gN],\n"
"                                     q8_0|q4_0|q4_1|q5_0, k4v2 (= quant),\n"
"                                     kivi:k4v2[:gG][:rR], k=C[/c],v=C[,r=R]\n"
"                                     (docs/quantized.md)\n"
"  ls [--model M]                     contexts\n"
"  stat CTX                           one context\n"
"";
/* (split: each string stays under the compiler's string-literal limit) */
static const char help_put[] =
"  put CTX FILE [--model M] [--mode create|append|upsert|replace] [--pin] [--protect N]\n"
"        [--persist]                  keep the context on disk (daemon --disk-dir):\n"
"                                     acknowledged once durable, survives restarts\n"
"        [--shm]                      payload through shared memory, not the socket\n"
"        [--share | --share-sync]     publish to kvroped's --remote-tier (after/before ack)\n"
"        [--tokens 1,2,3 | --tokens-file F] [--pos-start N | --positions p,q,..]\n"
"        [--dtype D --layers L --heads H --head-dim D] [--fingerprint HEX]\n"
"        [--codec SPEC]               create: the context's codec (default: model's)\n"
"                                     FILE *.safetensors: tensors k, v [layers][tokens]\n"
"                                     [heads][head_dim] (F32/F16/BF16), tokens and\n"
"                                     positions optional; model from its metadata.\n"
"                                     FILE *.npy: [layers, 2, tokens, heads, head_dim]\n"
"                                     float32/float16 (K then V per layer).\n"
"                                     Other FILE (or -): raw layer-major payload\n"
"                                     (per layer K then V, [tokens][heads][dim]); shape\n"
"                                     and dtype default to the model's.\n"
"                                     --tokens-file: text ids, *.bin u32 LE, *.npy\n"
"                                     (formats field by field: docs/formats.md;\n"
"                                     kvrope payload makes a FILE to try)\n"
"                                     --protect N: edits may not touch tokens [0,N)\n"
"  get CTX -o FILE [--start I] [--end J] [--dtype D] [--layers 0,1,..]\n"
"        [--positions p,q,.. | --pos-start N] [--meta] [--raw] [--shm]\n"
"                                     --shm: the daemon writes the KV into a memfd\n"
"                                     region of this process (Unix socket only)\n"
"                                     --raw: quantized contexts' stored bytes, keys\n"
"                                     pre-RoPE (layout: --json, docs/quantized.md)\n"
"                                     FILE by extension as for put: .safetensors,\n"
"                                     .npy (f32/f16), else raw (- = stdout);\n"
"                                     keys are re-rotated to the target positions\n"
"  match --model M (--tokens .. | --tokens-file F) [--approx] [--get -o FILE]\n"
"                                     longest cached exact prefix (+ its KV)\n"
"  rm CTX...                          delete contexts\n"
"  pin CTX | unpin CTX                protect from / expose to eviction\n"
"  fork SRC DST                       copy-on-write copy\n"
"  shift CTX START END DELTA          positions of tokens [START,END) += DELTA\n"
"  keep CTX START END                 keep tokens [START,END), drop the rest\n"
"";
static const char help_edit[] =
"  edit CTX --ops ops.json [--kv FILE [--dtype D]] [--plan]\n"
"                                     PIE edit, all ops at once. ops.json is an array\n"
"                                     of {\"start\": S, \"end\": E, \"tokens\": [ids]}:\n"
"                                     replace [S,E) of the CURRENT sequence with tokens\n"
"                                     (E omitted or == S: insert; no tokens: delete).\n"
"                                     Ops may not overlap or share a start.\n"
"                                     --plan: print where the new tokens land (index,\n"
"                                     first position), change nothing.\n"
"                                     --kv FILE: the new tokens' KV (all ops, in file\n"
"                                     order), K rotated at the planned positions;\n"
"                                     *.safetensors (k, v [layers][tokens][heads][dim])\n"
"                                     or raw layer-major. Without --kv the new tokens\n"
"                                     are pending (no KV) until a refresh.\n"
"  refresh CTX START END FILE         overwrite the KV of tokens [START,END) (K at\n"
"                                     their current positions; FILE as for --kv);\n"
"                                     clears their approximate/pending flags\n"
"";
static const char help_tail[] =
"  rope apply|remove|reposition ...   RoPE on raw files, no daemon (kvrope rope --help)\n"
"\n"
"Exit status:\n"
"  0  success\n"
"  1  the daemon refused the request, or an I/O error\n"
"  2  usage error\n"
"  3  not found: unknown context or model, or match found no cached prefix\n"
"  4  cannot connect to the daemon (or authentication failed)\n"
"\n"
"A progress bar is drawn on stderr for long transfers when it is a terminal.\n";

const char *cli_opt(const cli_args *a, const char *name)
{
    for (int i = a->nopt - 1; i >= 0; i--)
        if (!strcmp(a->opt_name[i], name))
            return a->opt_val[i];
    return NULL;
}

/* The options that take no value (every other --name takes one). */
static const char *const value_less[] = {
    "json", "quiet", "help", "pin", "get", "meta", "approx", "version", "plan", "raw",
    "persist", "shm", "share", "share-sync",
};

static bool is_flag(const char *name)
{
    for (size_t i = 0; i < sizeof value_less / sizeof value_less[0]; i++)
        if (!strcmp(name, value_less[i]))
            return true;
    return false;
}

bool cli_flag(const cli_args *a, const char *name)
{
    for (int i = 0; i < a->nopt; i++)
        if (!strcmp(a->opt_name[i], name))
            return true;
    return false;
}

static void default_socket(char *buf, size_t cap)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg && *xdg)
        snprintf(buf, cap, "%s/kvrope/kvroped.sock", xdg);
    else if (geteuid() == 0)
        snprintf(buf, cap, "/run/kvrope/kvroped.sock");
    else
        snprintf(buf, cap, "/tmp/kvrope-%u/kvroped.sock", (unsigned)getuid());
}

/* Returns 0, or CLI_USAGE after printing why. */
static int parse_args(int argc, char **argv, cli_args *a)
{
    memset(a, 0, sizeof *a);
    bool opts_done = false;
    for (int i = 1; i < argc; i++) {
        char *s = argv[i];
        if (!opts_done && !strcmp(s, "--")) {
            opts_done = true;
            continue;
        }
        if (!opts_done && s[0] == '-' && s[1] != 0) {
            char namebuf[64];
            const char *name, *val = NULL;
            if (s[1] == '-') {
                const char *eq = strchr(s + 2, '=');
                size_t nl = eq ? (size_t)(eq - s - 2) : strlen(s + 2);
                if (nl >= sizeof namebuf) {
                    fprintf(stderr, "kvrope: unknown option %s\n", s);
                    return CLI_USAGE;
                }
                memcpy(namebuf, s + 2, nl);
                namebuf[nl] = 0;
                name = namebuf;
                if (eq)
                    val = eq + 1;
            } else if (!strcmp(s, "-o")) {
                name = "output";
            } else if (!strcmp(s, "-q")) {
                name = "quiet";
            } else if (!strcmp(s, "-h")) {
                name = "help";
            } else {   /* a negative number as a positional (shift DELTA) */
                char *e;
                (void)strtoll(s, &e, 0);
                if (*e) {
                    fprintf(stderr, "kvrope: unknown option %s\n", s);
                    return CLI_USAGE;
                }
                goto positional;
            }
            if (cli_option_takes_value(name) || cli_layout_option_takes_value(name) ||
                cli_llama_option_takes_value(name) || cli_payload_option_takes_value(name)) {
                if (!val) {
                    if (i + 1 >= argc) {
                        fprintf(stderr, "kvrope: option --%s needs a value\n", name);
                        return CLI_USAGE;
                    }
                    val = argv[++i];
                }
            } else if (val) {
                fprintf(stderr, "kvrope: option --%s takes no value\n", name);
                return CLI_USAGE;
            } else if (!is_flag(name) && !cli_layout_option_is_flag(name) &&
                       !cli_llama_option_is_flag(name)) {
                fprintf(stderr, "kvrope: unknown option --%s\n", name);
                return CLI_USAGE;
            }
            if (a->nopt == CLI_MAX_OPTS) {
                fprintf(stderr, "kvrope: too many options\n");
                return CLI_USAGE;
            }
            /* Keep the name: copy into argv-lifetime storage. */
            char *dup = strdup(name);
            if (!dup)
                return CLI_USAGE;
            a->opt_name[a->nopt] = dup;
            a->opt_val[a->nopt++] = val;
            continue;
        }
    positional:
        if (!a->cmd) {
            a->cmd = s;
        } else {
            if (a->npos == CLI_MAX_POS) {
                fprintf(stderr, "kvrope: too many arguments\n");
                return CLI_USAGE;
            }
            a->pos[a->npos++] = s;
        }
    }
    a->socket = cli_opt(a, "socket");
    a->connect = cli_opt(a, "connect");
    a->token_file = cli_opt(a, "token-file");
    a->json = cli_flag(a, "json");
    a->quiet = cli_flag(a, "quiet");
    return 0;
}

static void free_args(cli_args *a)
{
    for (int i = 0; i < a->nopt; i++)
        free((void *)(uintptr_t)a->opt_name[i]);
}

static int read_token(const char *path, char **out, size_t *len)
{
    cli_mapped m;
    char err[300];
    if (cli_map_file(path, &m, err, sizeof err) < 0) {
        fprintf(stderr, "kvrope: token file: %s\n", err);
        return -1;
    }
    size_t n = m.len;
    const char *p = m.base;
    while (n && (p[n - 1] == '\n' || p[n - 1] == '\r'))
        n--;
    *out = malloc(n + 1);
    if (*out) {
        if (n)
            memcpy(*out, p, n);
        (*out)[n] = 0;
    }
    *len = n;
    cli_unmap(&m);
    return *out ? 0 : -1;
}

static void print_help(FILE *f)
{
    fputs(help_text, f);
    fputs(help_put, f);
    fputs(help_edit, f);
    fputs(cli_layout_help, f);
    fputs(cli_layout_help_file, f);
    fputs(cli_payload_help, f);
    fputs(cli_llama_help, f);
    fputs(help_tail, f);
}

/* Whether the help entry starting at line `e` (two spaces, then its words)
 * is about `cmd` (and, when sub is not NULL, its subcommand `sub`). The
 * first word names the command; "pin CTX | unpin CTX" names two. */
static bool entry_is(const char *e, const char *cmd, const char *sub)
{
    size_t n = strlen(cmd);
    const char *eol = strchr(e, '\n');
    if (!eol)
        eol = e + strlen(e);
    for (const char *w = e; w && w < eol; w = strstr(w, " | ")) {
        while (*w == ' ' || *w == '|')
            w++;
        if (!strncmp(w, cmd, n) && (w[n] == ' ' || w[n] == '\n' || w[n] == 0)) {
            if (!sub)
                return true;
            const char *s2 = w + n;
            while (*s2 == ' ')
                s2++;
            size_t m = strlen(sub);
            return !strncmp(s2, sub, m) && (s2[m] == ' ' || s2[m] == '\n' || s2[m] == 0);
        }
    }
    return false;
}

/* Prints (to out, or only counts when out is NULL) the entries of `text`
 * (help lines from "  WORD" to the next such line) that are about cmd
 * [sub]; returns how many. */
static int print_entries(FILE *out, const char *text, const char *cmd, const char *sub)
{
    int found = 0;
    const char *p = text;
    while (*p) {
        const char *eol = strchr(p, '\n');
        const char *next = eol ? eol + 1 : p + strlen(p);
        if (p[0] == ' ' && p[1] == ' ' && p[2] != ' ' && p[2] != '\n' && entry_is(p + 2, cmd, sub)) {
            /* The entry: this line and every more-indented line after it. */
            const char *end = next;
            while (end[0] == ' ' && end[1] == ' ' && end[2] == ' ') {
                const char *e2 = strchr(end, '\n');
                end = e2 ? e2 + 1 : end + strlen(end);
            }
            if (out)
                fwrite(p, 1, (size_t)(end - p), out);
            found++;
            next = end;
        }
        p = next;
    }
    return found;
}

/* `kvrope CMD --help`: that command's entries of the help only (for a
 * command with subcommands, `kvrope llama export --help` narrows to one). */
static bool print_command_help(const cli_args *a)
{
    const char *cmd = !strcmp(a->cmd, "list") ? "ls" : a->cmd;
    const char *const sections[] = { help_text, help_put, help_edit, cli_layout_help, cli_llama_help,
                                     cli_payload_help };
    const size_t n_sections = sizeof sections / sizeof sections[0];
    const char *sub = a->npos > 0 ? a->pos[0] : NULL;
    int n = 0;
    for (size_t i = 0; sub && i < n_sections; i++)
        n += print_entries(NULL, sections[i], cmd, sub);
    if (!n)
        sub = NULL;   /* `put --help` or `put ctx file --help`: every put entry */
    for (size_t i = 0; !sub && i < n_sections; i++)
        n += print_entries(NULL, sections[i], cmd, NULL);
    if (!n) {
        fprintf(stderr, "kvrope: no help for '%s' (kvrope --help lists every command)\n", cmd);
        return false;
    }
    printf("usage: kvrope [global options] %s%s%s ...\n", cmd, sub ? " " : "", sub ? sub : "");
    for (size_t i = 0; i < n_sections; i++)
        print_entries(stdout, sections[i], cmd, sub);
    fputs("Global options (--socket, --json, ...) and exit status: kvrope --help\n", stdout);
    return true;
}

int main(int argc, char **argv)
{
    /* `rope` needs none of our options: hand over argv untouched. */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "rope")) {
            if (!kvr_cli_rope_main) {
                fprintf(stderr, "kvrope: the rope subcommand is not built into this binary\n");
                return CLI_ERR;
            }
            return kvr_cli_rope_main(argc - i, argv + i);
        }
        if (argv[i][0] != '-')
            break;
        if (!strcmp(argv[i], "--socket") || !strcmp(argv[i], "--connect") ||
            !strcmp(argv[i], "--token-file") || !strcmp(argv[i], "--timeout"))
            i++;
    }
    cli_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) {
        free_args(&a);
        return rc;
    }
    if (cli_flag(&a, "version") || (a.cmd && !strcmp(a.cmd, "version"))) {
        printf("kvrope %d.%d.%d (libkvrope %s, protocol 1)\n", KVR_VERSION_MAJOR,
               KVR_VERSION_MINOR, KVR_VERSION_PATCH, kvr_version_string());
        free_args(&a);
        return CLI_OK;
    }
    if (a.cmd && !strcmp(a.cmd, "help") && a.npos > 0) {   /* kvrope help put */
        a.cmd = a.pos[0];
        memmove(a.pos, a.pos + 1, (size_t)--a.npos * sizeof a.pos[0]);
        rc = print_command_help(&a) ? CLI_OK : CLI_USAGE;
        free_args(&a);
        return rc;
    }
    if (cli_flag(&a, "help") || (a.cmd && !strcmp(a.cmd, "help"))) {
        rc = CLI_OK;
        if (!a.cmd || !strcmp(a.cmd, "help"))
            print_help(stdout);
        else if (!print_command_help(&a))
            rc = CLI_USAGE;
        free_args(&a);
        return rc;
    }
    if (!a.cmd) {
        print_help(stderr);
        free_args(&a);
        return CLI_USAGE;
    }
    if (!cli_known_command(a.cmd) && !cli_layout_command(a.cmd) && !cli_llama_command(a.cmd) &&
        !cli_payload_command(a.cmd)) {
        fprintf(stderr, "kvrope: unknown command '%s' (see kvrope --help)\n", a.cmd);
        free_args(&a);
        return CLI_USAGE;
    }

    char addr[512];
    const char *connect_to = a.connect ? a.connect : getenv("KVROPE_CONNECT");
    const char *sock = a.socket ? a.socket : getenv("KVROPE_SOCKET");
    if (a.socket || !connect_to || !*connect_to) {
        if (sock && *sock)
            snprintf(addr, sizeof addr, "unix:%s", sock);
        else {
            char def[400];
            default_socket(def, sizeof def);
            snprintf(addr, sizeof addr, "unix:%s", def);
        }
    } else {
        snprintf(addr, sizeof addr, "tcp:%s", connect_to);
    }
    kvr_client_opts opts = { 0 };
    char *token = NULL;
    const char *tf = a.token_file ? a.token_file : getenv("KVROPE_TOKEN_FILE");
    if (tf && *tf) {
        if (read_token(tf, &token, &opts.token_len) < 0) {
            free_args(&a);
            return CLI_USAGE;
        }
        opts.token = token;
        if (opts.token_len == 0)
            opts.token = "";
    }
    const char *to = cli_opt(&a, "timeout");
    if (to)
        opts.timeout_ms = atoi(to);
    kvr_client *c;
    int r = kvr_client_connect(&c, addr, &opts);
    free(token);
    if (r < 0) {
        fprintf(stderr, "kvrope: %s\n", kvr_client_last_error(NULL));
        if (!strncmp(addr, "unix:", 5) && strstr(kvr_client_last_error(NULL), "cannot connect")) {
            char def[400];
            default_socket(def, sizeof def);
            fprintf(stderr, "kvrope: is kvroped running? `make run` starts it on %s%s\n"
                    "kvrope: elsewhere: --socket PATH or KVROPE_SOCKET=PATH\n", def,
                    strcmp(addr + 5, def) ? " (this tried another path)" : "");
            /* `sudo make run`: the socket is in root's private directory. */
            struct stat rs;
            if (geteuid() != 0 && stat("/run/kvrope", &rs) == 0 && rs.st_uid == 0)
                fprintf(stderr, "kvrope: a make run as root listens in /run/kvrope, which only "
                        "root can open: run `make run` as yourself (install the packages once "
                        "with `sudo scripts/deps.sh run`)\n");
        }
        if (a.json) {
            printf("{\"error\": {\"code\": %d, \"name\": \"%s\", \"message\": \"cannot connect\"}}\n",
                   r, kvr_error_name(r));
        }
        free_args(&a);
        return CLI_CONNECT;
    }
    rc = cli_layout_command(a.cmd)    ? cli_layout_run(c, &a)
       : cli_llama_command(a.cmd)   ? cli_llama_run(c, &a)
       : cli_payload_command(a.cmd) ? cli_payload_run(c, &a)
                                    : cli_run(c, &a);
    kvr_client_close(c);
    free_args(&a);
    return rc;
}
