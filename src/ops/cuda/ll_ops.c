/*
 * The epx_ll_* entries of the CUDA backend: fill the kernels' arguments, launch, and
 * hand back views of the slot's device memory. Nothing waits on the host, so every
 * call is asynchronous and capturable in a CUDA graph; a peer that does not answer is
 * masked on the device and reported through epx_get_async_error (epx__cuda_ll_poll).
 */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"

static epx__cuda_ll_t *ll_of(epx_buffer_t buffer)
{
    return ((epx__cuda_buffer_t *)buffer->impl)->ll;
}

static epx_status_t launched(int err, const char *what)
{
    if (err == cudaSuccess)
        return EPX_SUCCESS;
    return EPX_CUDA_ERROR((cudaError_t)err, "%s: launching the low-latency kernel", what);
}

/* The kernels move 16-byte vectors: rows must start on 16 bytes. */
static void dispatch_views(epx_buffer_t buffer, const epx__cuda_ll_t *ll, int slot,
                           const epx_ll_dispatch_args_t *args, epx_ll_dispatch_result_t *result)
{
    const epx_ll_shape_t *s = &ll->shape;
    char *sym = s->sym + s->slot[slot];
    epx__ll_dispatch_views(buffer, args, sym + s->recv_x, sym + s->recv_scales,
                           s->local[slot] + s->recv_count, sym + s->recv_src_info,
                           sym + s->recv_range, result);
    result->num_masked_entries = -1; /* counted on the device only */
}

epx_status_t epx__cuda_ll_dispatch(epx_buffer_t buffer, int slot, const epx_ll_dispatch_args_t *args,
                                   epx_ll_dispatch_result_t *result, void *stream)
{
    epx__cuda_ll_t *ll = ll_of(buffer);
    epx_ll_op_t op;
    memset(&op, 0, sizeof(op));
    op.slot = slot;
    op.tokens = args->x.shape[0];
    op.x = args->x.data;
    op.x_stride = epx__tensor_row_stride(&args->x);
    op.topk_idx = args->topk_idx.data;
    op.idx_stride = epx__tensor_row_stride(&args->topk_idx);
    op.use_fp8 = args->use_fp8;
    op.round_scale = args->round_scale;
    op.use_ue8m0 = args->use_ue8m0;
    ll->slots[slot].use_fp8 = args->use_fp8;
    ll->slots[slot].use_ue8m0 = args->use_ue8m0;
    ll->slots[slot].tokens = op.tokens;
    ll->slots[slot].recv_stats = args->cumulative_local_expert_recv_stats.data;
    ll->slots[slot].wait_stats = args->wait_recv_cost_stats.data;
    if (ll->shape.kernels == 2) {
        /* A whole call is one launch: the send, then block 0 receives. */
        int whole = !(args->flags & EPX_LL_SEND_ONLY);
        op.recv_stats = ll->slots[slot].recv_stats;
        op.wait_stats = ll->slots[slot].wait_stats;
        ll->slots[slot].dispatch_received = whole;
        EPX_CHECK(launched(ll->plugin->dispatch2(&ll->shape, &op,
                                                 EPX_LL_RUN_SEND | (whole ? EPX_LL_RUN_RECV : 0),
                                                 stream),
                           "ll_dispatch"));
    } else {
        EPX_CHECK(launched(ll->plugin->dispatch_send(&ll->shape, &op, stream), "ll_dispatch"));
    }
    dispatch_views(buffer, ll, slot, args, result);
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_ll_dispatch_receive(epx_buffer_t buffer, int slot, void *stream)
{
    epx__cuda_ll_t *ll = ll_of(buffer);
    epx_ll_op_t op;
    memset(&op, 0, sizeof(op));
    op.slot = slot;
    op.tokens = ll->slots[slot].tokens;
    op.use_fp8 = ll->slots[slot].use_fp8;
    op.use_ue8m0 = ll->slots[slot].use_ue8m0;
    op.recv_stats = ll->slots[slot].recv_stats;
    op.wait_stats = ll->slots[slot].wait_stats;
    if (ll->shape.kernels == 2) {
        if (ll->slots[slot].dispatch_received) {
            ll->slots[slot].dispatch_received = 0;
            return EPX_SUCCESS;
        }
        return launched(ll->plugin->dispatch2(&ll->shape, &op, EPX_LL_RUN_RECV, stream),
                        "ll_dispatch (receive)");
    }
    return launched(ll->plugin->dispatch_recv(&ll->shape, &op, stream), "ll_dispatch (receive)");
}

epx_status_t epx__cuda_ll_combine(epx_buffer_t buffer, int slot, const epx_ll_combine_args_t *args,
                                  void *stream)
{
    epx__cuda_ll_t *ll = ll_of(buffer);
    epx_ll_op_t *op = &ll->slots[slot].combine;
    memset(op, 0, sizeof(*op));
    op->slot = slot;
    op->tokens = ll->slots[slot].tokens;
    op->x = args->x.data;
    op->topk_idx = args->topk_idx.data;
    op->idx_stride = epx__tensor_row_stride(&args->topk_idx);
    op->weights = args->topk_weights.data;
    op->weight_stride = epx__tensor_row_stride(&args->topk_weights);
    op->out = args->out.data;
    op->out_stride = epx__tensor_row_stride(&args->out);
    op->wait_stats = args->wait_recv_cost_stats.data; /* kept for the receive, like *op */
    if (ll->shape.kernels == 2) {
        int whole = !(args->flags & EPX_LL_SEND_ONLY);
        ll->slots[slot].combine_received = whole;
        return launched(ll->plugin->combine2(&ll->shape, op,
                                             EPX_LL_RUN_SEND | (whole ? EPX_LL_RUN_RECV : 0),
                                             stream),
                        "ll_combine");
    }
    return launched(ll->plugin->combine_send(&ll->shape, op, stream), "ll_combine");
}

epx_status_t epx__cuda_ll_combine_receive(epx_buffer_t buffer, int slot,
                                          epx_ll_combine_result_t *result, void *stream)
{
    epx__cuda_ll_t *ll = ll_of(buffer);
    if (result != NULL)
        result->num_masked_entries = -1;
    if (ll->shape.kernels == 2) {
        if (ll->slots[slot].combine_received) {
            ll->slots[slot].combine_received = 0;
            return EPX_SUCCESS;
        }
        return launched(ll->plugin->combine2(&ll->shape, &ll->slots[slot].combine,
                                             EPX_LL_RUN_RECV, stream),
                        "ll_combine (receive)");
    }
    return launched(ll->plugin->combine_recv(&ll->shape, &ll->slots[slot].combine, stream),
                    "ll_combine (receive)");
}

epx_status_t epx__cuda_ll_combine_buffer(epx_buffer_t buffer, int slot, void **base)
{
    const epx__cuda_ll_t *ll = ll_of(buffer);
    *base = ll->shape.sym + ll->shape.slot[slot] + ll->shape.combine_in;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_ll_mask_rank(epx_buffer_t buffer, int rank)
{
    const epx__cuda_ll_t *ll = ll_of(buffer);
    const int32_t one = 1;
    EPX_CUDA_CHECK(cudaMemcpy(ll->shape.mask + rank, &one, sizeof(one), cudaMemcpyHostToDevice),
                   "ll_mask_rank: writing the device mask");
    return EPX_SUCCESS;
}

void epx__cuda_ll_get_masked(epx_buffer_t buffer, int32_t *mask)
{
    const epx__cuda_ll_t *ll = ll_of(buffer);
    int R = buffer->group->world_size;
    if (cudaMemcpy(mask, ll->shape.mask, (size_t)R * sizeof(int32_t), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        memset(mask, 0, (size_t)R * sizeof(int32_t));
    }
}

epx_status_t epx__cuda_ll_check_wait_stats(epx_buffer_t buffer, const char *op)
{
    if (ll_of(buffer)->shape.kernels == 2)
        return EPX_SUCCESS;
    /* Every rank runs the same kernels (one config, one EPX_LL_KERNELS), so every rank
     * refuses alike and no peer is left waiting for a send. */
    return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                     "%s: wait_recv_cost_stats is timed by the low-latency kernels 2 (the "
                     "default, EPX_LL_KERNELS=2) only; this buffer runs kernels 1 "
                     "(EPX_LL_KERNELS=1, or a config kernels 2 do not serve: num_topk above "
                     "%d, or too many experts for their shared memory)",
                     op, EPX_LL2_MAX_TOPK);
}

static const char *ll_stage_name(int stage)
{
    switch (stage) {
    case EPX_LL_STAGE_DISPATCH_RELEASE:
        return "ll_dispatch (waiting for receivers to release the slot)";
    case EPX_LL_STAGE_DISPATCH:
        return "ll_dispatch (waiting for tokens)";
    case EPX_LL_STAGE_COMBINE_RELEASE:
        return "ll_combine (waiting for home ranks to release the slot)";
    case EPX_LL_STAGE_COMBINE:
        return "ll_combine (waiting for expert outputs)";
    case EPX_LL_STAGE_DISPATCH_COUNTS:
        return "ll_dispatch (waiting for peers' row counts)";
    default:
        return "a low-latency operation";
    }
}

void epx__cuda_ll_poll(epx_buffer_t buffer)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    if (cuda == NULL || cuda->ll == NULL)
        return;
    volatile epx_ll_fail_t *f = cuda->ll->fail;
    if (f->bad_id && !f->bad_reported) {
        /* Found on the device (the host never reads topk_idx); the entry was left out. */
        f->bad_reported = 1;
        int k = buffer->config.num_topk;
        char text[sizeof(buffer->ll_peer_message)];
        snprintf(text, sizeof(text),
                 "%s: topk_idx[%lld][%lld] is %lld, expected -1 (none) or an expert id in "
                 "0..%d; the entry was treated as -1",
                 f->bad_stage == EPX_LL_STAGE_COMBINE ? "ll_combine" : "ll_dispatch",
                 (long long)(f->bad_index / k), (long long)(f->bad_index % k),
                 (long long)f->bad_value, buffer->config.num_experts - 1);
        EPX_WARN(EPX_SUBSYS_OPS, "%s", text);
        /* The first async error stays; a lost peer (below) outranks a bad id. */
        int expected = EPX_SUCCESS;
        if (atomic_compare_exchange_strong(&buffer->ll_peer_error, &expected, EPX_ERR_INVALID_ARG))
            snprintf(buffer->ll_peer_message, sizeof(buffer->ll_peer_message), "%s", text);
    }
    if (f->code == 0 || f->reported)
        return;
    f->reported = 1;
    snprintf(buffer->ll_peer_message, sizeof(buffer->ll_peer_message),
             "%s: rank %d did not answer within %lld ms (seen by rank %d); it is masked from "
             "now on",
             ll_stage_name(f->stage), f->peer, (long long)buffer->group->timeout_ms,
             buffer->group->rank);
    atomic_store(&buffer->ll_peer_error, EPX_ERR_TIMEOUT);
    EPX_WARN(EPX_SUBSYS_OPS, "%s", buffer->ll_peer_message);
}
