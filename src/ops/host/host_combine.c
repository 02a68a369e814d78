/*
 * Normal-mode combine on the host backend: the reverse route of a dispatch.
 *
 * 1. Each rank copies its expert outputs (rows in receive order) into its own staging
 *    region. Staging lets the home rank pull: it then reads every partial row of a
 *    token, sums them in a fixed order and writes the result once, so the sum is the
 *    same bits on every run (no race decides the order of additions). The order is the
 *    one that internode kernels can keep (docs/INTERNODE.md): rank order inside each
 *    node, rounded to one bf16 partial per node, the partials summed in node order.
 *    With one node this is the flat fp32 sum in rank order. With order_topk_idx
 *    (DeepEP V2's order, include/epx.h) "rank order" and "node order" become the order
 *    of each rank's and each node's last entry in the token's top-k row (epx__combine_
 *    sequence). The staging rows are
 *    also the zero-copy combine input (epx_get_combine_input): when x is that view,
 *    the rows are already in place and only the weights are copied.
 * 2. Barrier "data": every rank's staging rows are in place.
 * 3. Each rank reduces its own tokens from the peers' staging regions (starting from the
 *    caller's biases, if any).
 * 4. Barrier "done": no rank rewrites its staging region (next combine) while a peer
 *    may still be reading it.
 */
#include <inttypes.h>
#include <string.h>

#include "ops/host/bf16.h"
#include "ops/host/host.h"

epx_status_t epx__host_combine_input(epx_buffer_t buffer, void **base, int64_t *rows)
{
    epx__host_buffer_t *host = buffer->impl;
    *base = epx__host_region(host, buffer->group->rank, host->layout.stage_x);
    *rows = host->layout.capacity;
    return EPX_SUCCESS;
}

/* Copy the caller's combine inputs into this rank's staging region. */
static void epx__combine_stage(epx__host_buffer_t *host, const epx_combine_args_t *args, int rank,
                               int64_t rows, int64_t hidden, int num_topk)
{
    uint16_t *stage_x = epx__host_region(host, rank, host->layout.stage_x);
    int64_t x_stride = epx__tensor_row_stride(&args->x);
    /* x is the combine-input view (rows already staged), or other memory: copied. Any
     * other view into the staging region lies at or after its destination rows, so
     * moving the rows in order reads each one before anything overwrites it. */
    if (args->x.data != (void *)stage_x || x_stride != hidden)
        for (int64_t i = 0; i < rows; i++)
            memmove(stage_x + i * hidden, (const uint16_t *)args->x.data + i * x_stride,
                    (size_t)hidden * sizeof(uint16_t));
    if (!epx__tensor_given(&args->topk_weights))
        return;
    float *stage_weights = epx__host_region(host, rank, host->layout.stage_weights);
    int64_t weight_stride = epx__tensor_row_stride(&args->topk_weights);
    for (int64_t i = 0; i < rows; i++)
        memcpy(stage_weights + i * num_topk,
               (const float *)args->topk_weights.data + i * weight_stride,
               (size_t)num_topk * sizeof(float));
}

/*
 * Token t's summation order: `seq` gets the ranks that received t (send_row >= 0), in
 * rank order, or with order_topk_idx in the order of each rank's last entry in the
 * token's top-k row, ranks named nowhere after those, in rank order. Returns how many.
 * `last` is [world] scratch.
 */
static int epx__combine_sequence(const epx_combine_args_t *args, const struct epx_handle *handle,
                                 int64_t t, int num_topk, int local_experts, int *last, int *seq)
{
    int world = handle->world_size, n = 0;
    const int64_t *row = NULL;
    if (epx__tensor_given(&args->order_topk_idx))
        row = (const int64_t *)args->order_topk_idx.data +
              t * epx__tensor_row_stride(&args->order_topk_idx);
    for (int r = 0; r < world; r++)
        last[r] = -1;
    for (int j = 0; row != NULL && j < num_topk; j++)
        if (row[j] >= 0 && row[j] < (int64_t)world * local_experts)
            last[row[j] / local_experts] = j;
    /* Named ranks by the place of their last entry, then the others. */
    for (int j = 0; row != NULL && j < num_topk; j++) {
        if (row[j] < 0 || row[j] >= (int64_t)world * local_experts)
            continue;
        int r = (int)(row[j] / local_experts);
        if (last[r] == j && handle->send_row[t * world + r] >= 0)
            seq[n++] = r;
    }
    for (int r = 0; r < world; r++)
        if (last[r] < 0 && handle->send_row[t * world + r] >= 0)
            seq[n++] = r;
    return n;
}

/* acc[0, hidden) += rank r's staged row for token t; weight_acc likewise (if given). */
static void epx__combine_add_rank(epx__host_buffer_t *host, const struct epx_handle *handle,
                                  int64_t t, int r, int64_t hidden, int num_topk,
                                  int with_weights, float *acc, float *weight_acc)
{
    int64_t row = handle->send_row[t * handle->world_size + r];
    const uint16_t *x =
        (const uint16_t *)epx__host_region(host, r, host->layout.stage_x) + row * hidden;
    for (int64_t i = 0; i < hidden; i++)
        acc[i] += epx__bf16_to_float(x[i]);
    if (with_weights) {
        const float *w =
            (const float *)epx__host_region(host, r, host->layout.stage_weights) + row * num_topk;
        for (int j = 0; j < num_topk; j++)
            weight_acc[j] += w[j];
    }
}

/* out[t] = the rows of the ranks that received t, summed node by node (see the top). */
static void epx__combine_reduce(epx__host_buffer_t *host, const epx_combine_args_t *args,
                                const struct epx_handle *handle, int per_node, int64_t hidden,
                                int num_topk, int local_experts)
{
    int world = handle->world_size, nodes = world / per_node;
    int with_weights = epx__tensor_given(&args->out_topk_weights);
    int64_t out_stride = epx__tensor_row_stride(&args->out_x);
    int64_t weight_stride = with_weights ? epx__tensor_row_stride(&args->out_topk_weights) : 0;
    float *partial = host->accumulator, *total = host->accumulator + hidden;
    float *weight_partial = host->weight_sums, *weight_total = host->weight_sums + num_topk;
    int *seq = host->rank_scratch, *last = host->rank_scratch + world;
    int has_bias = epx__tensor_given(&args->bias[0]) || epx__tensor_given(&args->bias[1]);
    for (int64_t t = 0; t < handle->num_tokens; t++) {
        memset(total, 0, (size_t)hidden * sizeof(float));
        memset(weight_total, 0, (size_t)num_topk * sizeof(float));
        /* DeepEP's order: the biases first (bias_0 + bias_1, fp32). */
        for (int j = 0; j < 2 && has_bias; j++) {
            if (!epx__tensor_given(&args->bias[j]))
                continue;
            const uint16_t *bias = (const uint16_t *)args->bias[j].data +
                                   t * epx__tensor_row_stride(&args->bias[j]);
            for (int64_t i = 0; i < hidden; i++)
                total[i] += epx__bf16_to_float(bias[i]);
        }
        int n = epx__combine_sequence(args, handle, t, num_topk, local_experts, last, seq);
        if (has_bias && nodes == 1) {
            /* One node with biases: the rows one by one, one rounding (the node's partial
             * is not rounded on its own: nothing crosses a network). */
            for (int i = 0; i < n; i++)
                epx__combine_add_rank(host, handle, t, seq[i], hidden, num_topk, with_weights,
                                      total, weight_total);
        } else {
            /* Node by node, each node at the place of its last rank in the sequence, its
             * ranks in the sequence's order; one bf16 partial per node is what crosses the
             * network. */
            for (int i = 0; i < n; i++) {
                int node = seq[i] / per_node, later = 0;
                for (int j = i + 1; j < n && !later; j++)
                    later = seq[j] / per_node == node;
                if (later)
                    continue;
                memset(partial, 0, (size_t)hidden * sizeof(float));
                memset(weight_partial, 0, (size_t)num_topk * sizeof(float));
                for (int j = 0; j <= i; j++)
                    if (seq[j] / per_node == node)
                        epx__combine_add_rank(host, handle, t, seq[j], hidden, num_topk,
                                              with_weights, partial, weight_partial);
                for (int64_t h = 0; h < hidden; h++)
                    total[h] += epx__bf16_to_float(epx__float_to_bf16(partial[h]));
                if (with_weights)
                    for (int j = 0; j < num_topk; j++)
                        weight_total[j] += weight_partial[j];
            }
        }
        uint16_t *out = (uint16_t *)args->out_x.data + t * out_stride;
        for (int64_t i = 0; i < hidden; i++)
            out[i] = epx__float_to_bf16(total[i]);
        if (with_weights)
            memcpy((float *)args->out_topk_weights.data + t * weight_stride, weight_total,
                   (size_t)num_topk * sizeof(float));
    }
}

epx_status_t epx__host_combine(epx_buffer_t buffer, const epx_combine_args_t *args, void *stream)
{
    (void)stream;
    epx__host_buffer_t *host = buffer->impl;
    const struct epx_handle *handle = args->handle;
    int me = buffer->group->rank;
    int64_t hidden = buffer->config.hidden;
    int num_topk = buffer->config.num_topk;
    int64_t rows = handle->num_recv_tokens;
    if (rows < 0 || rows > host->layout.capacity)
        return EPX_ERROR(EPX_ERR_INTERNAL,
                         "combine: the handle says rank %d received %" PRId64
                         " rows; the buffer holds %" PRId64,
                         me, rows, host->layout.capacity);

    epx__host_announce(host, me, EPX__HOST_OP_COMBINE, 0, args->x.dtype, 0,
                       epx__tensor_given(&args->topk_weights));
    epx__combine_stage(host, args, me, rows, hidden, num_topk);
    EPX_CHECK(epx__shm_barrier(host->shm, "combine (waiting for data)"));
    EPX_CHECK(epx__host_check_calls(host, me, buffer->group->world_size, "combine"));
    epx__combine_reduce(host, args, handle, buffer->group->ranks_per_node, hidden, num_topk,
                        buffer->config.num_experts / buffer->group->world_size);
    return epx__shm_barrier(host->shm, "combine (waiting for peers to finish reading)");
}
