/*
 * For unit tests of the CUDA backend's host-side planning, which need no GPU: a group
 * struct with no rendezvous behind it.
 */
#ifndef EPX_TEST_CUDA_PLAN_GROUP_H
#define EPX_TEST_CUDA_PLAN_GROUP_H

#include <string.h>

#include "ops/group.h"

/* Rank `rank` of `world`, `per_node` ranks per node, on CUDA device 0. */
static inline struct epx_group cuda_plan_group(int rank, int world, int per_node)
{
    struct epx_group g;
    memset(&g, 0, sizeof(g));
    g.rank = rank;
    g.world_size = world;
    g.ranks_per_node = per_node;
    g.backend = EPX_BACKEND_CUDA;
    g.device = 0;
    g.timeout_ms = 1000;
    return g;
}

#endif /* EPX_TEST_CUDA_PLAN_GROUP_H */
