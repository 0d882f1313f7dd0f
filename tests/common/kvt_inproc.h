/*
 * kvt_inproc.h — the configuration of an in-process daemon for the programs
 * that run kvroped's loop themselves (kvr_daemon_create, sockets adopted
 * with kvr_daemon_adopt_fd, kvr_daemon_run_nowait): the connection-layer
 * unit tests and the wire fuzzer. Compiled into libtestcommon.a
 * (tests/common/kvt_inproc.c) with no Criterion, so that the fuzzer links
 * its object too.
 */
#ifndef KVR_TESTS_KVT_INPROC_H
#define KVR_TESTS_KVT_INPROC_H

#include "daemon/daemon.h"

/* *cfg = the defaults with no listening socket ("none"), a 64 MiB cap and
 * only errors logged (the process's log level too). The caller adds what
 * its test needs before kvr_daemon_create (and, before any libuv call,
 * kvr_daemon_init_allocator where the daemon's allocations are counted). */
void kvt_inproc_config(kvr_daemon_config *cfg);

#endif
