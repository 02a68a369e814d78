/*
 * Handle entry points. Backends make handles (epx__handle_alloc, src/ops/backend.c);
 * the caller reads and destroys them here. A handle is used only once the registry of
 * live objects (src/core/objects.h) knows it: a destroyed one is refused, not read.
 */
#include <stdlib.h>

#include "api.h"
#include "core/objects.h"

epx_status_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_HANDLE, handle, "handle_get_info", "handle"));
    if (info == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_get_info: info is NULL");
    if (info->size != sizeof(epx_handle_info_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "handle_get_info: info.size is %zu, expected %zu (use "
                         "EPX_HANDLE_INFO_INIT)",
                         info->size, sizeof(epx_handle_info_t));
    info->num_tokens = handle->num_tokens;
    info->num_recv_tokens = handle->num_recv_tokens;
    info->num_local_experts = handle->num_local_experts;
    info->expert_alignment = handle->expert_alignment;
    return EPX_SUCCESS;
}

epx_status_t epx_handle_get_rank_prefix_matrix(epx_handle_t handle, epx_tensor_t *matrix)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_HANDLE, handle, "handle_get_rank_prefix_matrix",
                                "handle"));
    if (matrix == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_get_rank_prefix_matrix: matrix is NULL");
    int world = handle->world_size;
    const void *data = handle->rank_prefix_device;
    if (data == NULL) {
        if (handle->num_recv_tokens < 0)
            return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                             "handle_get_rank_prefix_matrix: the handle of a worst-case dispatch "
                             "across nodes has its counts on the device only");
        if (handle->rank_prefix == NULL) {
            int32_t *prefix = calloc((size_t)world * (size_t)world, sizeof(int32_t));
            if (prefix == NULL)
                return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY,
                                 "handle_get_rank_prefix_matrix: out of host memory");
            /* rank_counts[s * world + r] = tokens s sent to r; prefix sums over s. */
            for (int r = 0; r < world; r++) {
                int32_t sum = 0;
                for (int src = 0; src < world; src++) {
                    sum += handle->rank_counts[src * world + r];
                    prefix[src * world + r] = sum;
                }
            }
            handle->rank_prefix = prefix;
        }
        data = handle->rank_prefix;
    }
    *matrix = epx_tensor_2d((void *)data, EPX_DTYPE_INT32, world, world);
    return EPX_SUCCESS;
}

epx_status_t epx_handle_destroy(epx_handle_t handle)
{
    epx__clear_error();
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_destroy: handle is NULL");
    /* Removal is the check: of two threads destroying the same handle, one wins. */
    if (!epx__object_remove(EPX__OBJECT_HANDLE, handle))
        return epx__object_check(EPX__OBJECT_HANDLE, handle, "handle_destroy", "handle");
    epx__handle_release(handle);
    return EPX_SUCCESS;
}
