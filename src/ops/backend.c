/*
 * The services of the backend interface (ops/backend.h): what a backend may call
 * without reaching up into the API layer.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/objects.h"
#include "ops/backend.h"

const epx__backend_ops_t *epx__backend_find(epx_backend_t backend)
{
#ifdef EPX_WITH_CUDA
    if (backend == EPX_BACKEND_CUDA)
        return &epx__cuda_backend;
#endif
    if (backend == EPX_BACKEND_HOST)
        return &epx__host_backend;
    return NULL;
}

void epx__buffer_set_async_error(epx_buffer_t buffer, epx_status_t status, const char *message)
{
    int expected = EPX_SUCCESS;
    if (status == EPX_SUCCESS)
        return;
    /* The first error wins; its message is written by the thread that won. */
    if (atomic_compare_exchange_strong(&buffer->async_error, &expected, (int)status))
        snprintf(buffer->async_message, sizeof(buffer->async_message), "%s",
                 message != NULL ? message : "");
}

/* ---------------------------------------------------------------- handles */

/*
 * Handles: the routing of one dispatch, kept so that combine can send results back and
 * a cached dispatch can skip the layout and count exchange. Backends make them; the
 * API layer (src/handle.c) reads and destroys them.
 */
struct epx_handle *epx__handle_alloc(epx_buffer_t buffer, int64_t num_tokens,
                                     int64_t num_recv_tokens)
{
    int world = buffer->group->world_size;
    struct epx_handle *handle = calloc(1, sizeof(*handle));
    if (handle == NULL)
        return NULL;
    handle->buffer = buffer;
    handle->buffer_serial = buffer->serial;
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
        handle->recv_src_token == NULL || handle->num_recv_per_expert == NULL ||
        epx__object_add(EPX__OBJECT_HANDLE, handle) != EPX_SUCCESS) {
        epx__handle_release(handle);
        return NULL;
    }
    return handle;
}

void epx__handle_free(struct epx_handle *handle)
{
    if (handle == NULL)
        return;
    epx__object_remove(EPX__OBJECT_HANDLE, handle);
    epx__handle_release(handle);
}

void epx__handle_release(struct epx_handle *handle)
{
    if (handle->backend_free != NULL)
        handle->backend_free(handle);
    free(handle->send_row);
    free(handle->rank_counts);
    free(handle->recv_src_rank);
    free(handle->recv_src_token);
    free(handle->num_recv_per_expert);
    free(handle->rank_prefix);
    /* The shell waits in the registry's quarantine, so its address is not reused soon. */
    epx__object_retire(handle);
}

/* ---------------------------------------------------------------- low-latency views */

void epx__ll_dispatch_views(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args, void *recv_x,
                            void *recv_scales, void *recv_count, void *src_info, void *range,
                            epx_ll_dispatch_result_t *result)
{
    int64_t num_local = buffer->num_local_experts, hidden = buffer->config.hidden;
    int64_t rows = buffer->config.max_low_latency_tokens * buffer->group->world_size;
    epx_tensor_t t = EPX_TENSOR_NONE;
    t.ndim = 3;
    t.shape[0] = num_local;
    t.shape[1] = rows;
    t.shape[2] = hidden;
    t.data = recv_x;
    t.dtype = args->use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    result->recv_x = t;
    result->recv_x_scales = (epx_tensor_t)EPX_TENSOR_NONE;
    if (args->use_fp8) {
        t.data = recv_scales;
        t.dtype = args->use_ue8m0 ? EPX_DTYPE_INT32 : EPX_DTYPE_FP32;
        t.shape[2] = args->use_ue8m0 ? hidden / EPX__UE8M0_GROUP : hidden / EPX__FP8_BLOCK;
        result->recv_x_scales = t;
    }
    result->recv_count = epx_tensor_1d(recv_count, EPX_DTYPE_INT32, num_local);
    result->recv_src_info = epx_tensor_2d(src_info, EPX_DTYPE_INT32, num_local, rows);
    result->recv_layout_range =
        epx_tensor_2d(range, EPX_DTYPE_INT64, num_local, buffer->group->world_size);
}
