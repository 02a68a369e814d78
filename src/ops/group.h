/*
 * The group object: filled by the API layer (src/group.c) when a group is created, read
 * by the backends (which ranks, which device, which timeout, the bootstrap).
 */
#ifndef EPX_OPS_GROUP_H
#define EPX_OPS_GROUP_H

#include <stdint.h>

#include "bootstrap/bootstrap.h"
#include "epx.h"
#include "transport/transport.h"

struct epx_group {
    int rank;
    int world_size;
    int local_rank;
    int ranks_per_node; /* resolved: world_size when the config said 0 */
    epx_backend_t backend; /* resolved, never AUTO */
    int device;            /* -1 for host */
    int64_t timeout_ms;    /* resolved: never 0 */
    epx__bootstrap_t *bootstrap;
};

/* The group as a transport sees it. */
static inline epx__transport_ranks_t epx__group_ranks(const struct epx_group *group)
{
    epx__transport_ranks_t ranks = {group->bootstrap, group->rank, group->world_size,
                                    group->device, group->timeout_ms};
    return ranks;
}

#endif /* EPX_OPS_GROUP_H */
