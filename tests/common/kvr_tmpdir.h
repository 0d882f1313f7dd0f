/*
 * kvr_tmpdir.h — header-only helper for tests that give a store a disk tier
 * in a temporary directory: removes such a directory (flat: the disk tier
 * writes no subdirectories) and everything in it.
 */
#ifndef KVR_TMPDIR_H
#define KVR_TMPDIR_H

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static inline void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char p[600];
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

#endif /* KVR_TMPDIR_H */
