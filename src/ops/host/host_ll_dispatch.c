/*
 * Low-latency dispatch on the host backend (host_ll.h has the memory layout).
 *
 * Send: wait until every unmasked receiver has released this slot's previous use, then
 * for each token and each distinct expert of its top-k (-1 skipped, masked ranks
 * skipped and counted) write the row (bf16, or cast to fp8 once per token) into the
 * receiver's staging at [local expert][this rank][i], i counting up in token order;
 * then publish the counts and raise the arrival flag at every unmasked receiver (also
 * when nothing was sent, so the receiver's wait ends).
 * Receive: wait for the arrival flags of the unmasked sources (timing each when
 * wait_recv_cost_stats is given), pack each expert's rows source by source (so rows are
 * ordered by source rank, then token), then release the slot to each source.
 */
#include <inttypes.h>
#include <string.h>

#include "ops/host/host.h"
#include "ops/host/host_ll.h"

/* The result views of a slot (contents valid after the receive). */
static void epx__ll_dispatch_views_host(epx_buffer_t buffer, epx__host_ll_t *ll, int slot,
                                        const epx_ll_dispatch_args_t *args,
                                        epx_ll_dispatch_result_t *result)
{
    const epx__host_ll_layout_t *l = &ll->layout;
    char *base = epx__host_ll_slot(ll, buffer->group->rank, slot);
    epx__ll_dispatch_views(buffer, args, base + l->recv_x, base + l->recv_scales,
                           base + l->recv_count, base + l->recv_src_info, base + l->recv_range,
                           result);
}

/* Does expert `e` appear in idx[0..j-1]? (one row per distinct expert of a token) */
static int epx__ll_seen_before(const int64_t *idx, int j, int64_t e)
{
    for (int i = 0; i < j; i++)
        if (idx[i] == e)
            return 1;
    return 0;
}

epx_status_t epx__host_ll_dispatch(epx_buffer_t buffer, int slot,
                                   const epx_ll_dispatch_args_t *args,
                                   epx_ll_dispatch_result_t *result, void *stream)
{
    (void)stream;
    epx__host_ll_t *ll = epx__host_ll_of(buffer);
    const epx__host_ll_layout_t *l = &ll->layout;
    epx__host_ll_slot_t *s = &ll->slots[slot];
    int world = buffer->group->world_size, me = buffer->group->rank;
    int num_local = buffer->num_local_experts, k = buffer->config.num_topk;
    int64_t hidden = buffer->config.hidden, m = l->max_tokens;
    int64_t tokens = args->x.shape[0];
    uint64_t seq = ++s->dispatch_seq;
    s->num_tokens = tokens;
    s->use_fp8 = args->use_fp8;
    s->use_ue8m0 = args->use_ue8m0;
    s->recv_stats = args->cumulative_local_expert_recv_stats.data;
    s->dispatch_wait_stats = args->wait_recv_cost_stats.data;
    s->dispatch_wait_start = epx__host_ll_wait_start(s->dispatch_wait_stats, args->flags);
    s->masked_entries = 0;
    for (int r = 0; r < world; r++)
        s->peers[r] = !ll->mask[r];

    /* The receivers must be done with this slot's previous dispatch. */
    epx_status_t peer_status =
        epx__host_ll_wait(ll, me, world, EPX__LL_FLAG_DISPATCH_DONE, slot, seq - 1,
                          "ll_dispatch (waiting for receivers to release the slot)", s, 0,
                          NULL);

    memset(ll->send_counts, 0, (size_t)buffer->config.num_experts * sizeof(int32_t));
    int64_t x_stride = epx__tensor_row_stride(&args->x);
    int64_t idx_stride = epx__tensor_row_stride(&args->topk_idx);
    int64_t scale_cols = args->use_fp8 ? hidden / EPX__FP8_BLOCK : 0;
    size_t row_bytes = (size_t)hidden * (args->use_fp8 ? 1 : 2);
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *x = (const uint16_t *)args->x.data + t * x_stride;
        const int64_t *idx = (const int64_t *)args->topk_idx.data + t * idx_stride;
        const void *row = x;
        int cast = 0;
        for (int j = 0; j < k; j++) {
            int64_t e = idx[j];
            if (e < 0 || epx__ll_seen_before(idx, j, e))
                continue;
            int r = (int)(e / num_local), local = (int)(e % num_local);
            if (!s->peers[r]) {
                s->masked_entries++;
                continue;
            }
            if (args->use_fp8 && !cast) {
                epx__host_ll_cast_fp8(x, hidden, args->round_scale, ll->cast_row,
                                      ll->cast_scales);
                row = ll->cast_row;
                cast = 1;
            }
            int64_t i = ll->send_counts[e]++;
            int64_t cell = ((int64_t)local * world + me) * m + i;
            char *dst = epx__host_ll_slot(ll, r, slot);
            memcpy(dst + l->stage_x + (size_t)cell * l->x_row_bytes, row, row_bytes);
            if (scale_cols)
                memcpy((float *)(dst + l->stage_scales) + cell * l->scale_cols, ll->cast_scales,
                       (size_t)scale_cols * sizeof(float));
            ((int32_t *)(dst + l->stage_token))[cell] = (int32_t)t;
            ((int32_t *)(dst + l->stage_topk))[cell] = j;
        }
    }
    for (int r = 0; r < world; r++) {
        if (!s->peers[r])
            continue;
        int32_t *counts = (int32_t *)(epx__host_ll_slot(ll, r, slot) + l->stage_count);
        for (int local = 0; local < num_local; local++)
            counts[local * world + me] = ll->send_counts[r * num_local + local];
        epx__shm_flag_store(epx__host_ll_flag(ll, r, EPX__LL_FLAG_DISPATCH, slot, me), seq);
    }
    epx__ll_dispatch_views_host(buffer, ll, slot, args, result);
    result->num_masked_entries = s->masked_entries;
    return peer_status;
}

epx_status_t epx__host_ll_dispatch_receive(epx_buffer_t buffer, int slot, void *stream)
{
    (void)stream;
    epx__host_ll_t *ll = epx__host_ll_of(buffer);
    const epx__host_ll_layout_t *l = &ll->layout;
    epx__host_ll_slot_t *s = &ll->slots[slot];
    int world = buffer->group->world_size, me = buffer->group->rank;
    int num_local = buffer->num_local_experts;
    int64_t hidden = buffer->config.hidden, m = l->max_tokens;
    epx_status_t peer_status = epx__host_ll_wait(
        ll, me, world, EPX__LL_FLAG_DISPATCH, slot, s->dispatch_seq,
        "ll_dispatch (waiting for tokens)", s, s->dispatch_wait_start, s->dispatch_wait_stats);

    char *base = epx__host_ll_slot(ll, me, slot);
    const int32_t *counts = (const int32_t *)(base + l->stage_count);
    size_t row_bytes = (size_t)hidden * (s->use_fp8 ? 1 : 2);
    int64_t scale_cols = s->use_fp8 ? hidden / EPX__FP8_BLOCK : 0;
    int64_t packed_cols = s->use_ue8m0 ? hidden / EPX__UE8M0_GROUP : scale_cols; /* in 4-byte words */
    for (int local = 0; local < num_local; local++) {
        int64_t pos = 0;
        for (int src = 0; src < world; src++) {
            int64_t count = s->peers[src] ? counts[local * world + src] : 0;
            int64_t first = pos;
            for (int64_t i = 0; i < count; i++, pos++) {
                int64_t cell = ((int64_t)local * world + src) * m + i;
                int64_t out = (int64_t)local * l->rows + pos;
                memcpy(base + l->recv_x + (size_t)out * row_bytes,
                       base + l->stage_x + (size_t)cell * l->x_row_bytes, row_bytes);
                const float *scales = (const float *)(base + l->stage_scales) + cell * l->scale_cols;
                if (s->use_ue8m0) {
                    /* Exponent byte of each power-of-two scale, four per int32. */
                    uint32_t *words = (uint32_t *)(base + l->recv_scales) + out * packed_cols;
                    for (int64_t w = 0; w < packed_cols; w++) {
                        uint32_t word = 0;
                        for (int b = 0; b < 4; b++) {
                            uint32_t bits;
                            memcpy(&bits, &scales[w * 4 + b], sizeof(bits));
                            word |= ((bits >> 23) & 0xffu) << (8 * b);
                        }
                        words[w] = word;
                    }
                } else if (scale_cols) {
                    memcpy((float *)(base + l->recv_scales) + out * scale_cols, scales,
                           (size_t)scale_cols * sizeof(float));
                }
                ((int32_t *)(base + l->recv_src_info))[out] =
                    ((const int32_t *)(base + l->stage_token))[cell];
                ((int32_t *)(base + l->recv_topk))[out] =
                    ((const int32_t *)(base + l->stage_topk))[cell];
                ((int32_t *)(base + l->recv_src_rank))[out] = src;
            }
            ((int64_t *)(base + l->recv_range))[local * world + src] =
                (int64_t)((uint64_t)first << 32 | (uint64_t)count);
        }
        ((int32_t *)(base + l->recv_count))[local] = (int32_t)pos;
        if (s->recv_stats != NULL)
            s->recv_stats[local] += (int32_t)pos;
    }
    /* This rank is done with the staging: the sources may refill the slot. */
    epx__host_ll_release(ll, s, me, world, EPX__LL_FLAG_DISPATCH_DONE, slot, s->dispatch_seq);
    return peer_status;
}
