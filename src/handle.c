/*
 * Handles: the routing of one dispatch, kept so that combine can send results back and
 * a cached dispatch can skip the layout and count exchange.
 */
#include <stdlib.h>

#include "internal.h"

struct epx_handle *epx__handle_alloc(epx_buffer_t buffer, int64_t num_tokens,
                                     int64_t num_recv_tokens)
{
    int world = buffer->group->world_size;
    struct epx_handle *handle = calloc(1, sizeof(*handle));
    if (handle == NULL)
        return NULL;
    handle->buffer = buffer;
    handle->world_size = world;
    handle->rank = buffer->group->rank;
    handle->num_local_experts = buffer->num_local_experts;
    handle->num_tokens = num_tokens;
    handle->num_recv_tokens = num_recv_tokens;
    /* calloc(0, ...) may return NULL; ask for at least one element so NULL means failure. */
    size_t recv = num_recv_tokens > 0 ? (size_t)num_recv_tokens : 1;
    size_t sent = num_tokens > 0 ? (size_t)num_tokens * (size_t)world : 1;
    handle->send_row = calloc(sent, sizeof(int32_t));
    handle->rank_counts = calloc((size_t)world * (size_t)world, sizeof(int32_t));
    handle->recv_src_rank = calloc(recv, sizeof(int32_t));
    handle->recv_src_token = calloc(recv, sizeof(int32_t));
    handle->num_recv_per_expert = calloc((size_t)buffer->num_local_experts, sizeof(int32_t));
    if (handle->send_row == NULL || handle->rank_counts == NULL || handle->recv_src_rank == NULL ||
        handle->recv_src_token == NULL || handle->num_recv_per_expert == NULL) {
        epx__handle_free(handle);
        return NULL;
    }
    return handle;
}

void epx__handle_free(struct epx_handle *handle)
{
    if (handle == NULL)
        return;
    if (handle->backend_free != NULL)
        handle->backend_free(handle);
    free(handle->send_row);
    free(handle->rank_counts);
    free(handle->recv_src_rank);
    free(handle->recv_src_token);
    free(handle->num_recv_per_expert);
    free(handle);
}

epx_status_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info)
{
    epx__clear_error();
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_get_info: handle is NULL");
    if (info == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_get_info: info is NULL");
    info->num_tokens = handle->num_tokens;
    info->num_recv_tokens = handle->num_recv_tokens;
    info->num_local_experts = handle->num_local_experts;
    info->expert_alignment = handle->expert_alignment;
    return EPX_SUCCESS;
}

epx_status_t epx_handle_destroy(epx_handle_t handle)
{
    epx__clear_error();
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "handle_destroy: handle is NULL");
    epx__handle_free(handle);
    return EPX_SUCCESS;
}
