/*
 * Normal-mode combine on the host backend: the reverse route of a dispatch.
 *
 * 1. Each rank copies its expert outputs (rows in receive order) into its own staging
 *    region. Staging lets the home rank pull: it then reads every partial row of a
 *    token, sums them in a fixed order and writes the result once, so the sum is the
 *    same bits on every run (no race decides the order of additions). The order is the
 *    one that internode kernels can keep (docs/INTERNODE.md): rank order inside each
 *    node, rounded to one bf16 partial per node, the partials summed in node order.
 *    With one node this is the flat fp32 sum in rank order. The staging rows are
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
 * Add node `node`'s contribution to token t into total / weight_total: the rows of its
 * ranks that received t, summed in rank order in fp32 from 0, then rounded to bf16 (the
 * weights stay fp32). `partial` and `weight_partial` are scratch. A node that did not
 * receive t adds nothing.
 */
static void epx__combine_add_node(epx__host_buffer_t *host, const struct epx_handle *handle,
                                  int64_t t, int node, int per_node, int64_t hidden,
                                  int num_topk, int with_weights, float *partial,
                                  float *weight_partial, float *total, float *weight_total)
{
    int world = handle->world_size;
    int received = 0;
    for (int r = node * per_node; r < (node + 1) * per_node; r++) {
        int64_t row = handle->send_row[t * world + r];
        if (row < 0)
            continue;
        if (!received) {
            memset(partial, 0, (size_t)hidden * sizeof(float));
            memset(weight_partial, 0, (size_t)num_topk * sizeof(float));
            received = 1;
        }
        const uint16_t *x =
            (const uint16_t *)epx__host_region(host, r, host->layout.stage_x) + row * hidden;
        for (int64_t i = 0; i < hidden; i++)
            partial[i] += epx__bf16_to_float(x[i]);
        if (with_weights) {
            const float *w = (const float *)epx__host_region(host, r, host->layout.stage_weights) +
                             row * num_topk;
            for (int j = 0; j < num_topk; j++)
                weight_partial[j] += w[j];
        }
    }
    if (!received)
        return;
    /* One bf16 partial per node is what crosses the network. */
    for (int64_t i = 0; i < hidden; i++)
        total[i] += epx__bf16_to_float(epx__float_to_bf16(partial[i]));
    if (with_weights)
        for (int j = 0; j < num_topk; j++)
            weight_total[j] += weight_partial[j];
}

/* out[t] = the rows of the ranks that received t, summed node by node (see the top). */
static void epx__combine_reduce(epx__host_buffer_t *host, const epx_combine_args_t *args,
                                const struct epx_handle *handle, int per_node, int64_t hidden,
                                int num_topk)
{
    int nodes = handle->world_size / per_node;
    int with_weights = epx__tensor_given(&args->out_topk_weights);
    int64_t out_stride = epx__tensor_row_stride(&args->out_x);
    int64_t weight_stride = with_weights ? epx__tensor_row_stride(&args->out_topk_weights) : 0;
    float *partial = host->accumulator, *total = host->accumulator + hidden;
    float *weight_partial = host->weight_sums, *weight_total = host->weight_sums + num_topk;
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
        if (has_bias && nodes == 1) {
            /* One node with biases: then the rows in rank order, one rounding (the node's
             * partial is not rounded on its own: nothing crosses a network). */
            for (int r = 0; r < handle->world_size; r++) {
                int64_t row = handle->send_row[t * handle->world_size + r];
                if (row < 0)
                    continue;
                const uint16_t *x = (const uint16_t *)epx__host_region(host, r,
                                                                       host->layout.stage_x) +
                                    row * hidden;
                for (int64_t i = 0; i < hidden; i++)
                    total[i] += epx__bf16_to_float(x[i]);
                if (with_weights) {
                    const float *w = (const float *)epx__host_region(
                                         host, r, host->layout.stage_weights) +
                                     row * num_topk;
                    for (int j = 0; j < num_topk; j++)
                        weight_total[j] += w[j];
                }
            }
        } else {
            for (int node = 0; node < nodes; node++)
                epx__combine_add_node(host, handle, t, node, per_node, hidden, num_topk,
                                      with_weights, partial, weight_partial, total,
                                      weight_total);
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
    epx__combine_reduce(host, args, handle, buffer->group->ranks_per_node, hidden, num_topk);
    return epx__shm_barrier(host->shm, "combine (waiting for peers to finish reading)");
}
