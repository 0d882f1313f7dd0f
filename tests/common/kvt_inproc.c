/*
 * kvt_inproc.c — the in-process daemon's configuration (kvt_inproc.h).
 */
#include <stdio.h>

#include "tests/common/kvt_inproc.h"

void kvt_inproc_config(kvr_daemon_config *cfg)
{
    kvr_daemon_config_init(cfg);
    snprintf(cfg->socket_path, sizeof cfg->socket_path, "none");
    cfg->max_memory = 64u << 20;
    cfg->log_level = KVR_LOG_ERROR;
    kvr_log_set_level(KVR_LOG_ERROR);
}
