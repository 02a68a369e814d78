/*
 * Tool support entry points of the API layer (include/epx_tool.h): planning a buffer
 * for a group that is not formed (its size; internode normal mode's layout), and finding
 * the NVSHMEM plugin.
 */
#include <stdio.h>
#include <string.h>

#include "api.h"
#include "epx_tool.h"
#include "validate.h"
#ifdef EPX_WITH_CUDA
#include "transport/nvshmem/nvshmem.h"
#endif

epx_status_t epx_buffer_size_plan(epx_backend_t backend, int world_size, int ranks_per_node,
                                  const epx_buffer_config_t *config, size_t *bytes_per_rank)
{
    epx__clear_error();
    if (world_size < 1)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_size_plan: world_size %d is less than 1",
                         world_size);
    if (ranks_per_node < 0 || (ranks_per_node > 0 && world_size % ranks_per_node != 0))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer_size_plan: ranks_per_node %d does not divide world_size %d "
                         "(0 = all ranks on one node)",
                         ranks_per_node, world_size);
    if (backend == EPX_BACKEND_AUTO) {
        const epx__backend_ops_t *cuda = epx__backend_find(EPX_BACKEND_CUDA);
        int devices = cuda != NULL && cuda->device_count != NULL ? cuda->device_count() : 0;
        backend = devices > 0 ? EPX_BACKEND_CUDA : EPX_BACKEND_HOST;
    }
    if (backend != EPX_BACKEND_HOST && backend != EPX_BACKEND_CUDA)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer_size_plan: backend %d is not an epx_backend_t value (auto, "
                         "host, cuda)",
                         (int)backend);
    /* epx_buffer_size reads only the group's shape: a group that never talks answers. */
    struct epx_group group;
    memset(&group, 0, sizeof(group));
    group.world_size = world_size;
    group.ranks_per_node = ranks_per_node > 0 ? ranks_per_node : world_size;
    group.backend = backend;
    group.device = backend == EPX_BACKEND_CUDA ? 0 : -1;
    group.timeout_ms = epx__param_int(EPX_PARAM_TIMEOUT_MS);
    return epx__buffer_size(&group, config, bytes_per_rank);
}

epx_status_t epx_internode_plan(int world_size, int ranks_per_node,
                                const epx_buffer_config_t *config, epx_internode_plan_t *plan)
{
    epx__clear_error();
    if (plan == NULL || plan->size != sizeof(*plan))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "internode_plan: plan is NULL or its size is not "
                         "sizeof(epx_internode_plan_t) (use EPX_INTERNODE_PLAN_INIT)");
    if (ranks_per_node < 1 || world_size < 2 * ranks_per_node ||
        world_size % ranks_per_node != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "internode_plan: %d ranks of %d per node are not two nodes or more "
                         "(ranks_per_node must divide world_size and be at most half of it)",
                         world_size, ranks_per_node);
    const epx__backend_ops_t *cuda = epx__backend_find(EPX_BACKEND_CUDA);
    if (cuda == NULL || cuda->internode_plan == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "internode_plan: this epx was built without the CUDA backend, whose "
                         "internode normal mode it describes");
    struct epx_group group;
    memset(&group, 0, sizeof(group));
    group.world_size = world_size;
    group.ranks_per_node = ranks_per_node;
    group.backend = EPX_BACKEND_CUDA;
    group.timeout_ms = epx__param_int(EPX_PARAM_TIMEOUT_MS);
    size_t bytes = 0;
    EPX_CHECK(epx__buffer_size(&group, config, &bytes));
    epx_buffer_config_t full;
    epx__buffer_config_read(config, &full);
    epx_internode_plan_t answer = EPX_INTERNODE_PLAN_INIT;
    EPX_CHECK(cuda->internode_plan(&group, &full, &answer));
    answer.bytes_per_rank = bytes;
    *plan = answer;
    return EPX_SUCCESS;
}

epx_status_t epx_nvshmem_plugin_probe(char *path, size_t path_size, int version[3])
{
    epx__clear_error();
    if (path == NULL || path_size == 0 || version == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "nvshmem_plugin_probe: %s",
                         version == NULL ? "version is NULL" : "path is NULL or empty");
#ifdef EPX_WITH_CUDA
    const char *found = NULL;
    int seen[3] = {0, 0, 0};
    EPX_CHECK(epx__nvshmem_probe(&found, seen));
    snprintf(path, path_size, "%s", found);
    memcpy(version, seen, sizeof(seen));
    return EPX_SUCCESS;
#else
    return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                     "nvshmem_plugin_probe: this epx was built without CUDA, so it never loads "
                     "the NVSHMEM plugin");
#endif
}
