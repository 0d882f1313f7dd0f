/* main.c — kvroped's entry point; everything lives in the daemon/ library
 * (kvr_daemon_main) so tests can drive the same code. */
#include "daemon/daemon.h"

#ifdef KVR_JEMALLOC
#include "base/malloc_conf.h"
/* jemalloc's options for kvroped: freed pages stay mapped for the next
 * request, and retained extents are split for smaller requests (why:
 * base/malloc_conf.h). */
const char *malloc_conf = KVR_MALLOC_CONF;
#endif

int main(int argc, char **argv)
{
    return kvr_daemon_main(argc, argv);
}
