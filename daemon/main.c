/* main.c — kvroped's entry point; everything lives in the daemon/ library
 * (kvr_daemon_main) so tests can drive the same code. */
#include "daemon/daemon.h"

#ifdef KVR_JEMALLOC
/* jemalloc's options for kvroped. Pages freed by a delete or an eviction
 * are kept for the next put instead of being handed back on jemalloc's
 * decay clock: a put into freshly mapped pages faults them in 4 KiB at a
 * time, which cost ~8x the copy itself (1 MiB-64 MiB puts, issue 14). The
 * memory held stays under --max-memory (the cap counts live allocations;
 * retained pages are what the cap allowed before), and server.c's sweep
 * gives them back to the kernel once the daemon has been idle for a while. */
const char *malloc_conf = "dirty_decay_ms:-1,muzzy_decay_ms:-1";
#endif

int main(int argc, char **argv)
{
    return kvr_daemon_main(argc, argv);
}
