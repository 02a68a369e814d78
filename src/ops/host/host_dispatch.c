/*
 * Normal-mode dispatch on the host backend (docs/DESIGN.md section 2).
 *
 * 1. Route: which ranks get each token (from topk_idx, or the caller's is_token_in_rank
 *    and num_tokens_per_expert); send counts per rank and per expert go into
 *    this rank's call area (fresh mode), or come from the handle (cached mode).
 * 2. Barrier "counts": every rank has entered the call and published its counts, and
 *    every rank is done with the results of its previous dispatch, so they may be
 *    overwritten.
 * 3. Each rank writes its tokens straight into every receiver's receive region, one
 *    copy per byte. Rows from source s start at receiver r after the rows of the lower
 *    sources, sum over s' < s of count[s'][r], so every receiver sees them ordered by
 *    source rank, then token.
 * 4. Barrier "data": every row has landed. The handle and the outputs are built from
 *    this rank's own receive region.
 */
#include <inttypes.h>
#include <string.h>

#include "ops/host/host.h"

/* The facts of one call, resolved once from the buffer and the arguments. */
typedef struct {
    int world;
    int rank;
    int num_local;
    int num_topk;
    int64_t tokens;
    epx_dtype_t dtype;
    size_t row_bytes;   /* one x row of this call's dtype */
    int64_t scale_cols; /* hidden / 128 when x is fp8, else 0 */
    int has_idx;
    int has_weights;
} epx__dispatch_plan_t;

static epx__dispatch_plan_t epx__dispatch_plan(epx_buffer_t buffer, const epx_dispatch_args_t *args)
{
    epx__dispatch_plan_t plan;
    plan.world = buffer->group->world_size;
    plan.rank = buffer->group->rank;
    plan.num_local = buffer->num_local_experts;
    plan.num_topk = buffer->config.num_topk;
    plan.tokens = args->x.shape[0];
    plan.dtype = args->x.dtype;
    plan.row_bytes = (size_t)buffer->config.hidden * epx_dtype_size(plan.dtype);
    plan.scale_cols = plan.dtype == EPX_DTYPE_FP8_E4M3 ? buffer->config.hidden / EPX__FP8_BLOCK : 0;
    plan.has_idx = epx__tensor_given(&args->topk_idx);
    plan.has_weights = epx__tensor_given(&args->topk_weights);
    return plan;
}

/* Fresh mode: route[t * R + r] = index of t among the tokens sent to r, or -1. */
static epx_status_t epx__dispatch_route(epx__host_buffer_t *host, epx_buffer_t buffer,
                                        const epx_dispatch_args_t *args,
                                        const epx__dispatch_plan_t *plan)
{
    int world = plan->world;
    int32_t *rank_counts = epx__host_region(host, plan->rank, host->layout.count_rank);
    int32_t *expert_counts = epx__host_region(host, plan->rank, host->layout.count_expert);
    memset(rank_counts, 0, (size_t)world * sizeof(int32_t));
    memset(expert_counts, 0, (size_t)buffer->config.num_experts * sizeof(int32_t));
    if (!plan->has_idx) {
        /* Routed by the layout: the caller's bits and per-expert counts, as given. */
        const uint8_t *in_rank = args->is_token_in_rank.data;
        int64_t in_stride = epx__tensor_row_stride(&args->is_token_in_rank);
        memcpy(expert_counts, args->num_tokens_per_expert.data,
               (size_t)buffer->config.num_experts * sizeof(int32_t));
        for (int64_t t = 0; t < plan->tokens; t++)
            for (int r = 0; r < world; r++)
                host->route[t * world + r] = in_rank[t * in_stride + r] ? rank_counts[r]++ : -1;
        return EPX_SUCCESS;
    }
    const int64_t *idx = args->topk_idx.data;
    int64_t stride = epx__tensor_row_stride(&args->topk_idx);
    for (int64_t t = 0; t < plan->tokens; t++) {
        memset(host->rank_hit, 0, (size_t)world);
        EPX_CHECK(epx__host_route_token("dispatch", idx + t * stride, plan->num_topk, t,
                                        buffer->config.num_experts, plan->num_local, host->rank_hit,
                                        expert_counts));
        for (int r = 0; r < world; r++)
            host->route[t * world + r] = host->rank_hit[r] ? rank_counts[r]++ : -1;
    }
    return EPX_SUCCESS;
}

/* A caller-owned output must hold every received row. */
static epx_status_t epx__check_output_rows(const epx_tensor_t *tensor, const char *name,
                                           int64_t num_recv, int rank)
{
    if (!epx__tensor_given(tensor) || tensor->shape[0] >= num_recv)
        return EPX_SUCCESS;
    return EPX_ERROR(EPX_ERR_CAPACITY,
                     "dispatch: %s has %" PRId64 " rows but rank %d receives %" PRId64 " tokens",
                     name, tensor->shape[0], rank, num_recv);
}

static epx_status_t epx__check_outputs(const epx_dispatch_args_t *args, int64_t num_recv, int rank)
{
    EPX_CHECK(epx__check_output_rows(&args->recv_x, "recv_x", num_recv, rank));
    EPX_CHECK(epx__check_output_rows(&args->recv_x_scales, "recv_x_scales", num_recv, rank));
    EPX_CHECK(epx__check_output_rows(&args->recv_topk_idx, "recv_topk_idx", num_recv, rank));
    return epx__check_output_rows(&args->recv_topk_weights, "recv_topk_weights", num_recv, rank);
}

/*
 * Fresh mode, after the counts barrier: the handle, from every rank's published counts.
 * Rows that this rank's tokens take at receiver r start after those of lower ranks.
 */
static epx_status_t epx__dispatch_make_handle(epx__host_buffer_t *host, epx_buffer_t buffer,
                                              const epx_dispatch_args_t *args,
                                              const epx__dispatch_plan_t *plan,
                                              struct epx_handle **out)
{
    int world = plan->world, me = plan->rank;
    int64_t num_recv = 0;
    for (int s = 0; s < world; s++)
        num_recv += ((const int32_t *)epx__host_region(host, s, host->layout.count_rank))[me];
    if (num_recv > host->layout.capacity)
        return EPX_ERROR(EPX_ERR_INTERNAL,
                         "dispatch: rank %d would receive %" PRId64
                         " rows, more than the buffer's %" PRId64,
                         me, num_recv, host->layout.capacity);
    EPX_CHECK(epx__check_outputs(args, num_recv, me));
    struct epx_handle *handle = epx__handle_alloc(buffer, plan->tokens, num_recv);
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY,
                         "dispatch: no host memory for the handle of "
                         "%" PRId64 " tokens sent, %" PRId64 " received",
                         plan->tokens, num_recv);
    handle->expert_alignment = args->expert_alignment;
    for (int s = 0; s < world; s++) {
        const int32_t *counts = epx__host_region(host, s, host->layout.count_rank);
        memcpy(handle->rank_counts + (size_t)s * world, counts, (size_t)world * sizeof(int32_t));
    }
    for (int r = 0; r < world; r++) {
        int32_t base = 0;
        for (int s = 0; s < me; s++)
            base += handle->rank_counts[s * world + r];
        for (int64_t t = 0; t < plan->tokens; t++) {
            int32_t local = host->route[t * world + r];
            handle->send_row[t * world + r] = local >= 0 ? base + local : -1;
        }
    }
    int align = args->expert_alignment > 1 ? args->expert_alignment : 1;
    for (int i = 0; i < plan->num_local; i++) {
        int64_t sum = 0;
        for (int s = 0; s < world; s++)
            sum += ((const int32_t *)epx__host_region(
                host, s, host->layout.count_expert))[me * plan->num_local + i];
        handle->num_recv_per_expert[i] = (int32_t)((sum + align - 1) / align * align);
    }
    *out = handle;
    return EPX_SUCCESS;
}

/* Cached mode, after the counts barrier: every sender must route as the handle says. */
static epx_status_t epx__dispatch_check_handle(epx__host_buffer_t *host,
                                               const struct epx_handle *handle,
                                               const epx__dispatch_plan_t *plan)
{
    for (int s = 0; s < plan->world; s++) {
        int32_t sent =
            ((const int32_t *)epx__host_region(host, s, host->layout.count_rank))[plan->rank];
        int32_t expected = handle->rank_counts[s * plan->world + plan->rank];
        if (sent != expected)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "dispatch (cached): rank %d sends %d tokens to rank %d, whose handle "
                             "expects %d (the ranks' handles come from different dispatches)",
                             s, sent, plan->rank, expected);
    }
    return EPX_SUCCESS;
}

/* Write this rank's tokens into every receiver's receive region. */
static void epx__dispatch_send(epx__host_buffer_t *host, const epx_dispatch_args_t *args,
                               const epx__dispatch_plan_t *plan, const int32_t *send_row)
{
    const epx__host_layout_t *l = &host->layout;
    int world = plan->world, k = plan->num_topk, num_local = plan->num_local;
    size_t element = epx_dtype_size(plan->dtype);
    int64_t x_stride = epx__tensor_row_stride(&args->x);
    int64_t scale_stride = plan->scale_cols ? epx__tensor_row_stride(&args->x_scales) : 0;
    int64_t scale_col_stride = plan->scale_cols ? epx__tensor_col_stride(&args->x_scales) : 1;
    int64_t idx_stride = plan->has_idx ? epx__tensor_row_stride(&args->topk_idx) : 0;
    int64_t weight_stride = plan->has_weights ? epx__tensor_row_stride(&args->topk_weights) : 0;
    for (int64_t t = 0; t < plan->tokens; t++) {
        const char *x = (const char *)args->x.data + (size_t)(t * x_stride) * element;
        for (int r = 0; r < world; r++) {
            int64_t row = send_row[t * world + r];
            if (row < 0)
                continue;
            memcpy((char *)epx__host_region(host, r, l->recv_x) + (size_t)row * plan->row_bytes, x,
                   plan->row_bytes);
            if (plan->scale_cols) {
                float *out = (float *)epx__host_region(host, r, l->recv_scales) +
                             row * plan->scale_cols;
                const float *in = (const float *)args->x_scales.data + t * scale_stride;
                for (int64_t i = 0; i < plan->scale_cols; i++)
                    out[i] = in[i * scale_col_stride];
            }
            int64_t *idx_out = (int64_t *)epx__host_region(host, r, l->recv_idx) + row * k;
            float *weights_out = (float *)epx__host_region(host, r, l->recv_weights) + row * k;
            const int64_t *idx =
                plan->has_idx ? (const int64_t *)args->topk_idx.data + t * idx_stride : NULL;
            const float *weights = plan->has_weights
                                       ? (const float *)args->topk_weights.data + t * weight_stride
                                       : NULL;
            for (int j = 0; j < k && (idx != NULL || weights != NULL); j++) {
                /* Receivers see their own expert numbering; experts elsewhere are -1
                 * with weight 0, so a receiver never acts on a foreign expert. */
                int64_t local = -1;
                if (idx != NULL && idx[j] >= 0 && idx[j] / num_local == r)
                    local = idx[j] - (int64_t)r * num_local;
                if (idx != NULL)
                    idx_out[j] = local;
                if (weights != NULL)
                    weights_out[j] = idx == NULL || local >= 0 ? weights[j] : 0.0f;
            }
            ((int32_t *)epx__host_region(host, r, l->recv_src_rank))[row] = plan->rank;
            ((int32_t *)epx__host_region(host, r, l->recv_src_token))[row] = (int32_t)t;
        }
    }
}

/* Copy `rows` packed rows of `row_bytes` into a caller tensor with its own row stride. */
static void epx__copy_rows(const epx_tensor_t *out, const void *source, int64_t rows,
                           size_t row_bytes)
{
    size_t out_stride = (size_t)epx__tensor_row_stride(out) * epx_dtype_size(out->dtype);
    for (int64_t i = 0; i < rows; i++)
        memcpy((char *)out->data + (size_t)i * out_stride,
               (const char *)source + (size_t)i * row_bytes, row_bytes);
}

/* One output: the caller's tensor filled from the receive region, or a view into it. */
static epx_tensor_t epx__dispatch_output(const epx_tensor_t *given, void *region, epx_dtype_t dtype,
                                         int64_t rows, int64_t cols)
{
    size_t row_bytes = (size_t)cols * epx_dtype_size(dtype);
    if (epx__tensor_given(given)) {
        epx__copy_rows(given, region, rows, row_bytes);
        return *given;
    }
    return epx_tensor_2d(region, dtype, rows, cols);
}

static void epx__dispatch_results(epx__host_buffer_t *host, epx_buffer_t buffer,
                                  const epx_dispatch_args_t *args, const epx__dispatch_plan_t *plan,
                                  struct epx_handle *handle, epx_dispatch_result_t *result)
{
    const epx__host_layout_t *l = &host->layout;
    int me = plan->rank;
    int64_t rows = handle->num_recv_tokens;
    result->num_recv_tokens = rows;
    result->recv_x = epx__dispatch_output(&args->recv_x, epx__host_region(host, me, l->recv_x),
                                          plan->dtype, rows, buffer->config.hidden);
    if (plan->scale_cols)
        result->recv_x_scales =
            epx__dispatch_output(&args->recv_x_scales, epx__host_region(host, me, l->recv_scales),
                                 EPX_DTYPE_FP32, rows, plan->scale_cols);
    if (plan->has_idx)
        result->recv_topk_idx =
            epx__dispatch_output(&args->recv_topk_idx, epx__host_region(host, me, l->recv_idx),
                                 EPX_DTYPE_INT64, rows, plan->num_topk);
    if (plan->has_weights)
        result->recv_topk_weights = epx__dispatch_output(
            &args->recv_topk_weights, epx__host_region(host, me, l->recv_weights), EPX_DTYPE_FP32,
            rows, plan->num_topk);
    result->num_recv_tokens_per_expert = handle->num_recv_per_expert;
    result->num_local_experts = plan->num_local;
    result->num_recv_tokens_device = NULL;
    result->num_recv_tokens_per_expert_device = NULL;
    result->handle = handle;
}

epx_status_t epx__host_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                epx_dispatch_result_t *result, void *stream)
{
    (void)stream;
    epx__host_buffer_t *host = buffer->impl;
    epx__dispatch_plan_t plan = epx__dispatch_plan(buffer, args);
    struct epx_handle *cached = args->handle;
    int world = plan.world, me = plan.rank;
    /* The entry point checked this; the route scratch depends on it, so check again. */
    if (plan.tokens > buffer->config.max_tokens_per_rank)
        return EPX_ERROR(EPX_ERR_CAPACITY,
                         "dispatch: rank %d passed %" PRId64 " tokens, more "
                         "than the buffer's max_tokens_per_rank %" PRId64,
                         me, plan.tokens, buffer->config.max_tokens_per_rank);

    if (cached != NULL) {
        EPX_CHECK(epx__check_outputs(args, cached->num_recv_tokens, me));
        int32_t *counts = epx__host_region(host, me, host->layout.count_rank);
        memcpy(counts, cached->rank_counts + (size_t)me * world, (size_t)world * sizeof(int32_t));
    } else {
        EPX_CHECK(epx__dispatch_route(host, buffer, args, &plan));
    }
    epx__host_announce(host, me, EPX__HOST_OP_DISPATCH, cached != NULL, plan.dtype, plan.has_idx,
                       plan.has_weights);
    EPX_CHECK(epx__shm_barrier(host->shm, "dispatch (waiting for counts)"));
    EPX_CHECK(epx__host_check_calls(host, me, world, "dispatch"));

    struct epx_handle *handle = cached;
    if (cached != NULL)
        EPX_CHECK(epx__dispatch_check_handle(host, cached, &plan));
    else
        EPX_CHECK(epx__dispatch_make_handle(host, buffer, args, &plan, &handle));

    epx__dispatch_send(host, args, &plan, handle->send_row);
    epx_status_t status = epx__shm_barrier(host->shm, "dispatch (waiting for data)");
    if (status != EPX_SUCCESS) {
        if (handle != cached)
            epx__handle_free(handle);
        return status;
    }
    if (cached == NULL) {
        size_t bytes = (size_t)handle->num_recv_tokens * sizeof(int32_t);
        memcpy(handle->recv_src_rank, epx__host_region(host, me, host->layout.recv_src_rank),
               bytes);
        memcpy(handle->recv_src_token, epx__host_region(host, me, host->layout.recv_src_token),
               bytes);
    }
    epx__dispatch_results(host, buffer, args, &plan, handle, result);
    return EPX_SUCCESS;
}
