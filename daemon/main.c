/* main.c — kvroped's entry point; everything lives in the daemon/ library
 * (kvr_daemon_main) so tests can drive the same code. */
#include "daemon/daemon.h"

int main(int argc, char **argv)
{
    return kvr_daemon_main(argc, argv);
}
