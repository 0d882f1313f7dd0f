/*
 * main.c — the `kvrope` command-line tool: global options, then one
 * subcommand. `kvrope rope ...` is handed to the RoPE engine (cli_rope.c)
 * with argv[0] = "rope"; every other subcommand talks to kvroped through
 * libkvrope (cli_cmd.c).
 */
#include <stdio.h>
#include <string.h>

#include "client/cli/cli_rope.h"

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "rope") == 0)
        return kvr_cli_rope_main(argc - 1, argv + 1);
    fprintf(stderr, "usage: kvrope [options] COMMAND ...\n");
    return 2;
}
