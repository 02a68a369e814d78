/*
 * The host backend's buffer: one shared-memory segment per rank laid out as host.h
 * describes, plus the vtable that src/epx.c calls.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ops/host/host.h"
#include "ops/host/host_ll.h"

/* Place an array of count * element bytes at the next 64-byte boundary. */
static int epx__host_place(size_t *cursor, size_t *offset, int64_t count, size_t element)
{
    size_t bytes;
    size_t start = (*cursor + 63) / 64 * 64;
    if (count < 0 || start < *cursor || __builtin_mul_overflow((size_t)count, element, &bytes) ||
        __builtin_add_overflow(start, bytes, cursor))
        return -1;
    *offset = start;
    return 0;
}

epx_status_t epx__host_layout(int world_size, const epx_buffer_config_t *config,
                              epx__host_layout_t *layout)
{
    epx__host_layout_t l;
    memset(&l, 0, sizeof(l));
    int64_t hidden = config->hidden;
    int64_t k = config->num_topk;
    int64_t rows;
    /* Rows are sized for the wider of bf16 and fp8 (bf16) because a call may pass either
     * dtype; the config's dispatch_dtype is only a hint. */
    int64_t x_row_bytes;
    int failed = __builtin_mul_overflow(config->max_tokens_per_rank, (int64_t)world_size, &rows) ||
                 __builtin_mul_overflow(hidden, (int64_t)2, &x_row_bytes);
    l.capacity = rows;
    l.scale_cols = hidden % EPX__FP8_BLOCK == 0 ? hidden / EPX__FP8_BLOCK : 0;
    size_t cursor = 0;
    int64_t cells;
    failed = failed || epx__host_place(&cursor, &l.call, 1, sizeof(epx__host_call_t)) ||
             epx__host_place(&cursor, &l.count_rank, world_size, sizeof(int32_t)) ||
             epx__host_place(&cursor, &l.count_expert, config->num_experts, sizeof(int32_t)) ||
             __builtin_mul_overflow(rows, x_row_bytes, &cells) ||
             epx__host_place(&cursor, &l.recv_x, cells, 1) ||
             __builtin_mul_overflow(rows, l.scale_cols, &cells) ||
             epx__host_place(&cursor, &l.recv_scales, cells, sizeof(float)) ||
             __builtin_mul_overflow(rows, k, &cells) ||
             epx__host_place(&cursor, &l.recv_idx, cells, sizeof(int64_t)) ||
             epx__host_place(&cursor, &l.recv_weights, cells, sizeof(float)) ||
             epx__host_place(&cursor, &l.recv_src_rank, rows, sizeof(int32_t)) ||
             epx__host_place(&cursor, &l.recv_src_token, rows, sizeof(int32_t)) ||
             __builtin_mul_overflow(rows, x_row_bytes, &cells) ||
             epx__host_place(&cursor, &l.stage_x, cells, 1) ||
             __builtin_mul_overflow(rows, k, &cells) ||
             epx__host_place(&cursor, &l.stage_weights, cells, sizeof(float));
    if (failed)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: max_tokens_per_rank %" PRId64 " x %d ranks x hidden %" PRId64
                         " does not fit in memory sizes",
                         config->max_tokens_per_rank, world_size, hidden);
    l.total = (cursor + 63) / 64 * 64;
    *layout = l;
    return EPX_SUCCESS;
}

static epx_status_t epx__host_buffer_size(epx_group_t group, const epx_buffer_config_t *config,
                                          size_t *bytes)
{
    epx__host_layout_t layout;
    EPX_CHECK(epx__host_layout(group->world_size, config, &layout));
    *bytes = epx__shm_segment_bytes(layout.total);
    if (config->max_low_latency_tokens > 0) {
        epx__host_ll_layout_t ll_layout;
        EPX_CHECK(epx__host_ll_layout(group->world_size, config, &ll_layout));
        *bytes += epx__shm_segment_bytes(ll_layout.total);
    }
    return EPX_SUCCESS;
}

static void epx__host_free(epx__host_buffer_t *host)
{
    if (host == NULL)
        return;
    epx__host_ll_destroy(host->ll);
    epx__shm_destroy(host->shm);
    free(host->route);
    free(host->rank_hit);
    free(host->accumulator);
    free(host->weight_sums);
    free(host->rank_scratch);
    free(host);
}

static epx_status_t epx__host_buffer_create(epx_buffer_t buffer)
{
    epx_group_t group = buffer->group;
    const epx_buffer_config_t *config = &buffer->config;
    epx__host_layout_t layout;
    EPX_CHECK(epx__host_layout(group->world_size, config, &layout));

    /* Local memory first: a failure after the collective shm setup would leave the
     * peers with a buffer that this rank never uses. */
    epx__host_buffer_t *host = calloc(1, sizeof(*host));
    if (host != NULL) {
        size_t route_cells = (size_t)layout.capacity > 0 ? (size_t)layout.capacity : 1;
        host->route = malloc(route_cells * sizeof(int32_t));
        host->rank_hit = malloc((size_t)group->world_size);
        /* Combine sums node by node: a node's partial and the total, side by side. */
        host->accumulator = malloc(2 * (size_t)config->hidden * sizeof(float) + sizeof(float));
        host->weight_sums = malloc(2 * (size_t)config->num_topk * sizeof(float) + sizeof(float));
        host->rank_scratch = malloc(2 * (size_t)group->world_size * sizeof(int));
    }
    if (host == NULL || host->route == NULL || host->rank_hit == NULL ||
        host->accumulator == NULL || host->weight_sums == NULL || host->rank_scratch == NULL) {
        epx__host_free(host);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer: no host memory for rank %d's scratch",
                         group->rank);
    }
    host->layout = layout;
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    epx_status_t status = epx__shm_create(&ranks, layout.total, &host->shm);
    if (status != EPX_SUCCESS) {
        epx__host_free(host);
        return status;
    }
    /* Every rank has the same config (agreed before), so all take this collective step. */
    if (config->max_low_latency_tokens > 0) {
        status = epx__host_ll_create(buffer, &host->ll);
        if (status != EPX_SUCCESS) {
            epx__host_free(host);
            return status;
        }
    }
    EPX_DEBUG(EPX_SUBSYS_OPS, "host buffer: %zu bytes per rank, %" PRId64 " rows", layout.total,
              layout.capacity);
    buffer->impl = host;
    return EPX_SUCCESS;
}

static void epx__host_buffer_destroy(epx_buffer_t buffer, int all_ready)
{
    (void)all_ready; /* nothing here is freed collectively */
    /* No barrier: a peer still reading this rank's segment keeps its own mapping, and
     * the memory is released only when the last mapping goes. */
    epx__host_free(buffer->impl);
    buffer->impl = NULL;
}

static void epx__host_abort(epx_buffer_t buffer, epx_status_t status, const char *message)
{
    epx__host_buffer_t *host = buffer->impl;
    if (host != NULL)
        epx__shm_abort(host->shm, status, message);
    if (host != NULL && host->ll != NULL)
        epx__shm_abort(host->ll->shm, status, message);
}

static void epx__host_refuse(epx_buffer_t buffer, const char *message)
{
    epx__host_buffer_t *host = buffer->impl;
    if (host != NULL)
        epx__shm_refuse(host->shm, message);
}

static const char *epx__host_op_name(int32_t op)
{
    return op == EPX__HOST_OP_DISPATCH ? "dispatch" : op == EPX__HOST_OP_COMBINE ? "combine" : "?";
}

void epx__host_announce(epx__host_buffer_t *host, int rank, epx__host_op_t op, int cached,
                        epx_dtype_t x_dtype, int has_idx, int has_weights)
{
    epx__host_call_t *call = epx__host_region(host, rank, host->layout.call);
    call->sequence = ++host->sequence;
    call->op = op;
    call->cached = cached;
    call->x_dtype = x_dtype;
    call->has_idx = has_idx;
    call->has_weights = has_weights;
    call->pad = 0;
}

epx_status_t epx__host_check_calls(const epx__host_buffer_t *host, int rank, int world_size,
                                   const char *op)
{
    const epx__host_call_t *mine = epx__host_region(host, rank, host->layout.call);
    for (int r = 0; r < world_size; r++) {
        const epx__host_call_t *peer = epx__host_region(host, r, host->layout.call);
        if (peer->op != mine->op || peer->sequence != mine->sequence)
            return EPX_ERROR(EPX_ERR_INVALID_STATE,
                             "%s: rank %d is in %s (call %" PRId64 " on this buffer) while rank "
                             "%d is in %s (call %" PRId64 "): every rank must make the same "
                             "calls in the same order",
                             op, r, epx__host_op_name(peer->op), peer->sequence, rank,
                             epx__host_op_name(mine->op), mine->sequence);
        if (peer->cached != mine->cached)
            return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: rank %d passed %s handle, rank %d %s", op, r,
                             peer->cached ? "a" : "no", rank, mine->cached ? "did" : "did not");
        if (peer->x_dtype != mine->x_dtype)
            return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: rank %d passed x as %s, rank %d as %s", op,
                             r, epx_dtype_name((epx_dtype_t)peer->x_dtype), rank,
                             epx_dtype_name((epx_dtype_t)mine->x_dtype));
        if (peer->has_idx != mine->has_idx || peer->has_weights != mine->has_weights)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: rank %d passed topk_idx %s and topk_weights %s, rank %d %s and "
                             "%s (every rank must pass the same optional inputs)",
                             op, r, peer->has_idx ? "yes" : "no", peer->has_weights ? "yes" : "no",
                             rank, mine->has_idx ? "yes" : "no", mine->has_weights ? "yes" : "no");
    }
    return EPX_SUCCESS;
}

const epx__backend_ops_t epx__host_backend = {
    .name = "host",
    .caps = EPX__BACKEND_HOST_TENSORS,
    .buffer_size = epx__host_buffer_size,
    .buffer_create = epx__host_buffer_create,
    .buffer_destroy = epx__host_buffer_destroy,
    .abort = epx__host_abort,
    .refuse = epx__host_refuse,
    .layout = epx__host_layout_op,
    .dispatch = epx__host_dispatch,
    .combine = epx__host_combine,
    .combine_input = epx__host_combine_input,
    .ll_dispatch = epx__host_ll_dispatch,
    .ll_dispatch_receive = epx__host_ll_dispatch_receive,
    .ll_combine = epx__host_ll_combine,
    .ll_combine_receive = epx__host_ll_combine_receive,
    .ll_combine_buffer = epx__host_ll_combine_buffer,
    .ll_mask_rank = epx__host_ll_mask_rank,
    .ll_get_masked = epx__host_ll_get_masked,
    .fanout_copy = epx__host_fanout_copy,
    .fanin_reduce = epx__host_fanin_reduce,
    .ll_rejoin = epx__host_ll_rejoin,
};
