/*
 * Which ranks form a node (docs/INTERNODE.md): a node's ranks share memory (CUDA IPC on
 * the GPU, the CPU backend's shared memory), so they must share a host. Group creation
 * exchanges every rank's host name; from them this file either finds the node size when
 * nothing says it (neither config.ranks_per_node nor EPX_RANKS_PER_NODE), or checks that
 * the size given puts no two hosts in one node. Virtual nodes (several nodes on one host)
 * are what tests and benchmarks use; the other way round is a configuration error that
 * would otherwise surface much later, as a failed CUDA IPC mapping.
 */
#include <string.h>

#include "api.h"

static const char *host_of(const char *hosts, size_t stride, int rank)
{
    return hosts + (size_t)rank * stride;
}

epx_status_t epx__group_nodes(const char *hosts, size_t stride, int world_size, int given,
                              int *ranks_per_node)
{
    if (given > 0) {
        for (int r = 0; r < world_size; r++) {
            int first = r - r % given;
            if (strcmp(host_of(hosts, stride, r), host_of(hosts, stride, first)) != 0)
                return EPX_ERROR(EPX_ERR_INVALID_ARG,
                                 "group: ranks_per_node %d puts rank %d (host %s) in one node "
                                 "with rank %d (host %s), but a node's ranks must share a "
                                 "host: set ranks_per_node (EPX_RANKS_PER_NODE) to at most "
                                 "the ranks on each host",
                                 given, r, host_of(hosts, stride, r), first,
                                 host_of(hosts, stride, first));
        }
        *ranks_per_node = given;
        return EPX_SUCCESS;
    }
    /* Nothing given: the ranks on rank 0's host, when the ranks come host by host, the
     * same number on each. */
    int per = 1;
    while (per < world_size &&
           strcmp(host_of(hosts, stride, per), host_of(hosts, stride, 0)) == 0)
        per++;
    for (int r = per; r < world_size; r++) {
        const char *node_host = host_of(hosts, stride, r - r % per);
        int same_node = strcmp(host_of(hosts, stride, r), node_host) == 0;
        int earlier = 0;
        for (int n = 0; r % per == 0 && n < r; n += per)
            earlier |= strcmp(host_of(hosts, stride, n), node_host) == 0;
        if (world_size % per != 0 || !same_node || earlier) {
            /* As before host names were looked at: one node. Low-latency mode works so
             * (its peers on other hosts get puts); normal mode will not map them. */
            EPX_WARN(EPX_SUBSYS_CORE,
                     "group: cannot tell the nodes from the hosts (rank 0's host %s has the "
                     "first %d ranks; rank %d is on host %s), so all %d ranks count as one "
                     "node; normal mode across hosts needs the ranks placed host by host with "
                     "the same number on each, or ranks_per_node (EPX_RANKS_PER_NODE)",
                     host_of(hosts, stride, 0), per, r, host_of(hosts, stride, r), world_size);
            *ranks_per_node = world_size;
            return EPX_SUCCESS;
        }
    }
    *ranks_per_node = per;
    return EPX_SUCCESS;
}
