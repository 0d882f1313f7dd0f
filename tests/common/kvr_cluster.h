/*
 * kvr_cluster.h — helper for the remote-tier tests (kvr_cluster.c): starts a
 * 3-master / 3-replica Redis Cluster on loopback through
 * scripts/redis-cluster.sh (in a fresh temporary directory, ports picked at
 * random and retried if taken), and tears it down. The script's watcher
 * kills the servers if the test process dies first, so a crashed test never
 * leaves a cluster behind. Every wait is bounded.
 *
 * The cluster has an ACL user "kvr" / "kvrpass" (besides the default user).
 */
#ifndef KVR_CLUSTER_H
#define KVR_CLUSTER_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct kvr_tcluster {
    char dir[128];
    int  ports[6];
    char seeds[160];      /* "127.0.0.1:P1,127.0.0.1:P2" (two seeds) */
    char script[512];
} kvr_tcluster;

const char *tcluster_script(char *buf, size_t cap);

int tcluster_start(kvr_tcluster *t);

void tcluster_stop(kvr_tcluster *t);

/* Runs redis-cli against port with the given arguments, for at most secs
 * seconds; output in out. */
int tcluster_cli_for(const kvr_tcluster *t, int port, const char *args, char *out,
                     size_t cap, int secs);

/* The same for a command that answers at once (20 s at most). */
int tcluster_cli(const kvr_tcluster *t, int port, const char *args, char *out,
                 size_t cap);

/* SIGKILLs the server on port (a failover test). */
int tcluster_kill(const kvr_tcluster *t, int port);

/* Waits (bounded) until every live node reports cluster_state:ok. */
int tcluster_wait_ok(const kvr_tcluster *t, int secs);

/* Port of the master serving `slot` (CLUSTER SLOTS via redis-cli), or -1. */
int tcluster_master_of(const kvr_tcluster *t, unsigned slot);

#endif /* KVR_CLUSTER_H */
