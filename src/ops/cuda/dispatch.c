/*
 * Host side of dispatch on the CUDA backend.
 *
 * Two kernels on the caller's stream: the count exchange (layout.cu) and the data
 * kernel (dispatch.cu), then, when the caller gave output tensors, local copies into
 * them. All are queued before the host waits for anything, so the rows are already
 * moving while the host waits for the counts.
 *
 * Host-sync mode (the default) waits for the count exchange's results in host-mapped
 * memory (stamped with a ticket, with the group's timeout), so the result carries the
 * row count and a handle with the counts on the host. EPX_DISPATCH_WORST_CASE never
 * waits: outputs are sized for max_tokens_per_rank * world_size rows, the counts exist
 * only on the device (result *_device fields), and the call can be captured in a CUDA
 * graph. Cached mode (a handle) sends only the entry signal and reuses the handle's
 * routing from device memory.
 */
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/cuda_backend.h"

static void handle_free_state(struct epx_handle *handle)
{
    epx__cuda_handle_state_t *state = handle->backend_state;
    if (state == NULL)
        return;
    epx__cuda_pool_put(state->pool, state->slot);
    epx__cuda_pool_release(state->pool);
    free(state);
    handle->backend_state = NULL;
}

/* Device arrays for a fresh dispatch's routing, from the buffer's pool. */
static epx_status_t state_create(epx__cuda_buffer_t *cuda, epx__cuda_handle_state_t **out)
{
    epx__cuda_handle_state_t *state = calloc(1, sizeof(*state));
    if (state == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "dispatch: out of host memory");
    state->slot = epx__cuda_pool_get(cuda->pool);
    if (state->slot == NULL) {
        free(state);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "dispatch: no device memory for the handle (%s)",
                         epx_last_error());
    }
    state->pool = cuda->pool;
    epx__cuda_pool_retain(cuda->pool);
    /* Slots are sized for max_tokens_per_rank (layout: epx__cuda_plan). */
    int64_t send_bytes = cuda->shape.max_recv * 4;
    send_bytes = (send_bytes + 255) / 256 * 256;
    state->send_row = (int32_t *)state->slot;
    state->recv_count = (int32_t *)((char *)state->slot + send_bytes);
    state->recv_per_expert = (int32_t *)((char *)state->slot + send_bytes + 256);
    int64_t expert_bytes = ((int64_t)cuda->shape.num_local_experts * 4 + 255) / 256 * 256;
    int64_t prefix_bytes = ((int64_t)cuda->shape.world_size * cuda->shape.world_size * 4 + 255) /
                           256 * 256;
    state->rank_prefix = (int32_t *)((char *)state->slot + send_bytes + 256 + expert_bytes);
    epx__cuda_xn_routing(&cuda->shape, state->slot,
                         send_bytes + 256 + expert_bytes + prefix_bytes, &state->xn);
    *out = state;
    return EPX_SUCCESS;
}

/* A view of the receive region, or the caller's tensor after a local copy into it. */
static epx_status_t output(epx__cuda_buffer_t *cuda, const epx_tensor_t *given, int64_t offset,
                           epx_dtype_t dtype, int64_t rows, int64_t cols,
                           const int32_t *rows_device, cudaStream_t stream, epx_tensor_t *out)
{
    char *region = cuda->shared + offset;
    int64_t row_bytes = cols * (int64_t)epx_dtype_size(dtype);
    if (!epx__tensor_given(given)) {
        *out = epx_tensor_2d(region, dtype, rows, cols);
        return EPX_SUCCESS;
    }
    epx__cuda_copy_args_t c;
    memset(&c, 0, sizeof(c));
    c.src = region;
    c.src_pitch = row_bytes;
    c.dst = given->data;
    c.dst_pitch = epx__tensor_row_stride(given) * (int64_t)epx_dtype_size(dtype);
    c.row_bytes = row_bytes;
    /* Never past the caller's rows; the device caps it at the rows received. */
    c.rows = given->shape[0] < cuda->shape.max_recv ? given->shape[0] : cuda->shape.max_recv;
    c.rows_device = rows_device;
    EPX_CUDA_CHECK(epx__cuda_launch_copy(&c, cuda->num_sms, stream),
                   "dispatch: copying results into the caller's tensors");
    *out = *given;
    return EPX_SUCCESS;
}

static epx_status_t launch_kernels(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                   epx__cuda_handle_state_t *state, int fresh, uint64_t ticket,
                                   cudaStream_t stream)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    int64_t tokens = args->x.shape[0];

    epx__cuda_notify_args_t n;
    memset(&n, 0, sizeof(n));
    int has_idx = fresh && epx__tensor_given(&args->topk_idx);
    if (has_idx) {
        n.topk_idx = args->topk_idx.data;
        n.topk_stride = epx__tensor_row_stride(&args->topk_idx);
    } else if (fresh) {
        /* Routed by the layout (entry point: both given, checked). */
        n.is_token_in_rank = args->is_token_in_rank.data;
        n.in_rank_stride = epx__tensor_row_stride(&args->is_token_in_rank);
        n.num_tokens_per_expert = args->num_tokens_per_expert.data;
    }
    n.rank_prefix = state->rank_prefix;
    n.num_tokens = tokens;
    n.send_row = state->send_row;
    n.recv_count = state->recv_count;
    n.recv_per_expert = state->recv_per_expert;
    n.expert_alignment = args->expert_alignment > 1 ? args->expert_alignment : 1;
    n.max_blocks = cuda->num_sms;
    n.ticket = ticket;
    n.xn = state->xn;
    EPX_CUDA_CHECK(epx__cuda_run_notify(cuda, &n, stream),
                   "dispatch: launching the count exchange");

    size_t element = epx_dtype_size(args->x.dtype);
    epx__cuda_dispatch_args_t d;
    memset(&d, 0, sizeof(d));
    d.x = args->x.data;
    d.x_stride = epx__tensor_row_stride(&args->x) * (int64_t)element;
    d.row_bytes = buffer->config.hidden * (int64_t)element;
    d.recv_pitch = d.row_bytes;
    d.x_align = epx__cuda_alignment(d.x, d.x_stride);
    if (args->x.dtype == EPX_DTYPE_FP8_E4M3) {
        d.num_scales = (int)(buffer->config.hidden / EPX__FP8_BLOCK);
        d.scales = args->x_scales.data;
        d.scales_stride = epx__tensor_row_stride(&args->x_scales);
        d.scales_col_stride = epx__tensor_col_stride(&args->x_scales);
    }
    if (has_idx) {
        d.topk_idx = args->topk_idx.data;
        d.topk_stride = epx__tensor_row_stride(&args->topk_idx);
        if (epx__tensor_given(&args->topk_weights)) {
            d.topk_weights = args->topk_weights.data;
            d.weights_stride = epx__tensor_row_stride(&args->topk_weights);
        }
    }
    d.num_tokens = tokens;
    d.send_row = state->send_row;
    d.fresh = fresh;
    /* Internode: the forwarding kernel's work is the records that arrive, not known here. */
    d.num_blocks = cuda->xn != NULL ? cuda->num_sms : epx__cuda_blocks_for(cuda, tokens);
    d.xn = state->xn;
    d.kernels = cuda->kernels;
    d.num_sms = cuda->num_sms;
    EPX_CUDA_CHECK(epx__cuda_run_dispatch(cuda, &d, stream),
                   "dispatch: launching the data kernel");
    return EPX_SUCCESS;
}

/* Fill the result's tensors (views or copies) for `rows` rows. */
static epx_status_t fill_outputs(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                 const epx__cuda_handle_state_t *state, int64_t rows,
                                 cudaStream_t stream, epx_dispatch_result_t *result)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    const epx__cuda_shape_t *s = &cuda->shape;
    int64_t hidden = buffer->config.hidden, k = buffer->config.num_topk;
    const int32_t *count = state->recv_count;
    EPX_CHECK(output(cuda, &args->recv_x, s->off_x, args->x.dtype, rows, hidden, count, stream,
                     &result->recv_x));
    if (args->x.dtype == EPX_DTYPE_FP8_E4M3)
        EPX_CHECK(output(cuda, &args->recv_x_scales, s->off_scales, EPX_DTYPE_FP32, rows,
                         hidden / EPX__FP8_BLOCK, count, stream, &result->recv_x_scales));
    if (args->handle == NULL && epx__tensor_given(&args->topk_idx)) {
        EPX_CHECK(output(cuda, &args->recv_topk_idx, s->off_topk_idx, EPX_DTYPE_INT64, rows, k,
                         count, stream, &result->recv_topk_idx));
        if (epx__tensor_given(&args->topk_weights))
            EPX_CHECK(output(cuda, &args->recv_topk_weights, s->off_topk_weights, EPX_DTYPE_FP32,
                             rows, k, count, stream, &result->recv_topk_weights));
    }
    return EPX_SUCCESS;
}

/* Caller-owned outputs must hold every received row (checked once the count is known). */
static epx_status_t check_capacity(const epx_dispatch_args_t *args, int64_t rows)
{
    const epx_tensor_t *outputs[] = {&args->recv_x, &args->recv_x_scales, &args->recv_topk_idx,
                                     &args->recv_topk_weights};
    const char *names[] = {"recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"};
    for (int i = 0; i < 4; i++)
        if (epx__tensor_given(outputs[i]) && outputs[i]->shape[0] < rows)
            return EPX_ERROR(EPX_ERR_CAPACITY,
                             "dispatch: %s has %lld rows but this rank received %lld tokens",
                             names[i], (long long)outputs[i]->shape[0], (long long)rows);
    return EPX_SUCCESS;
}

/* The host copy of a fresh dispatch's routing: counts, and rows' source ranks. */
static struct epx_handle *make_handle(epx_buffer_t buffer, int64_t tokens, int64_t rows,
                                      int worst_case)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    int R = buffer->group->world_size, me = buffer->group->rank;
    struct epx_handle *handle = epx__handle_alloc(buffer, tokens, worst_case ? 0 : rows);
    if (handle == NULL)
        return NULL;
    if (worst_case) {
        /* Only the device knows; combine then accepts x with any row count. */
        handle->num_recv_tokens = -1;
        return handle;
    }
    memcpy(handle->rank_counts, cuda->mapped_rank_counts, (size_t)R * R * sizeof(int32_t));
    memcpy(handle->num_recv_per_expert, cuda->mapped_recv_per_expert,
           (size_t)buffer->num_local_experts * sizeof(int32_t));
    /* Rows arrive ordered by source rank: the source rank of each row follows from the
     * counts. Token indices and send_row stay on the device (backend_state). */
    int64_t row = 0;
    for (int src = 0; src < R; src++)
        for (int32_t i = 0; i < handle->rank_counts[src * R + me] && row < rows; i++)
            handle->recv_src_rank[row++] = src;
    for (int64_t t = 0; t < tokens * R; t++)
        handle->send_row[t] = -1;
    return handle;
}

epx_status_t epx__cuda_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                epx_dispatch_result_t *result, void *stream)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    cudaStream_t st = (cudaStream_t)stream;
    /* Fresh and cached dispatches alike: both signal peers through CUDA IPC. */
    EPX_CHECK(epx__cuda_poll(buffer));
    int64_t tokens = args->x.shape[0];
    int worst_case = (args->flags & EPX_DISPATCH_WORST_CASE) != 0;
    struct epx_handle *cached = args->handle;
    int fresh = cached == NULL;

    epx__cuda_handle_state_t *state = NULL;
    if (fresh)
        EPX_CHECK(state_create(cuda, &state));
    else
        state = cached->backend_state;
    if (state == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "dispatch: the handle has no CUDA routing");

    int host_knows = !fresh && cached->num_recv_tokens >= 0;
    uint64_t ticket = (!worst_case && !host_knows) ? ++cuda->next_ticket : 0;
    int64_t view_rows = worst_case ? cuda->shape.max_recv : 0;
    epx_status_t status = launch_kernels(buffer, args, state, fresh, ticket, st);
    if (status == EPX_SUCCESS && worst_case)
        status = fill_outputs(buffer, args, state, view_rows, st, result);

    int64_t rows = -1;
    if (status == EPX_SUCCESS && !worst_case) {
        if (host_knows)
            rows = cached->num_recv_tokens;
        else if ((status = epx__cuda_wait_ticket(buffer, ticket, "dispatch")) == EPX_SUCCESS)
            rows = cuda->mapped->num_recv;
        if (status == EPX_SUCCESS)
            status = check_capacity(args, rows);
        if (status == EPX_SUCCESS)
            status = fill_outputs(buffer, args, state, rows, st, result);
    }

    struct epx_handle *handle = cached;
    if (status == EPX_SUCCESS && fresh) {
        handle = make_handle(buffer, tokens, rows, worst_case);
        if (handle == NULL)
            status = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "dispatch: out of host memory for the handle");
    }
    if (status != EPX_SUCCESS) {
        if (fresh) {
            struct epx_handle shell;
            memset(&shell, 0, sizeof(shell));
            shell.backend_state = state;
            handle_free_state(&shell);
        }
        return status;
    }
    if (fresh) {
        handle->backend_state = state;
        handle->backend_free = handle_free_state;
        handle->rank_prefix_device = state->rank_prefix;
        handle->expert_alignment = args->expert_alignment;
    }

    result->num_recv_tokens = rows;
    result->num_local_experts = buffer->num_local_experts;
    result->num_recv_tokens_per_expert = NULL;
    if (!worst_case) {
        /* A worst-case handle learns its per-expert counts at its first host-sync use. */
        if (!fresh && !host_knows)
            memcpy(handle->num_recv_per_expert, cuda->mapped_recv_per_expert,
                   (size_t)buffer->num_local_experts * sizeof(int32_t));
        result->num_recv_tokens_per_expert = handle->num_recv_per_expert;
    }
    result->num_recv_tokens_device = state->recv_count;
    result->num_recv_tokens_per_expert_device = state->recv_per_expert;
    result->handle = handle;
    return EPX_SUCCESS;
}
