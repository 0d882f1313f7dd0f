/* cli_rope.h — `kvrope rope apply|remove|reposition`: the RoPE engine on raw
 * files, without a daemon. argv[0] is "rope". Returns the process exit code. */
#ifndef KVR_CLI_ROPE_H
#define KVR_CLI_ROPE_H
int kvr_cli_rope_main(int argc, char **argv);
#endif
