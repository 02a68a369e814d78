/*
 * Low-latency combine on the host backend (host_ll.h has the memory layout).
 *
 * Send: wait until every unmasked home rank has released this slot's previous combine,
 * then write each valid row of x (expert e, row i) into its token's home rank, at
 * combine staging [source token][top-k position of the row's first occurrence]; then
 * raise the combine flag at every unmasked home rank.
 * Receive: wait for the combine flags of the unmasked expert ranks (timing each when
 * wait_recv_cost_stats is given), then for each token out = bf16(sum over j of w_j * y_j)
 * in fp32, one fmaf per entry, j in order (the GPU's fused multiply-add, one rounding),
 * skipping -1 and adding nothing (and counting the entry) for experts on masked ranks;
 * release the slot.
 */
#include <math.h>
#include <string.h>

#include "ops/host/bf16.h"
#include "ops/host/host.h"
#include "ops/host/host_ll.h"

epx_status_t epx__host_ll_combine(epx_buffer_t buffer, int slot, const epx_ll_combine_args_t *args,
                                  void *stream)
{
    (void)stream;
    epx__host_ll_t *ll = epx__host_ll_of(buffer);
    const epx__host_ll_layout_t *l = &ll->layout;
    epx__host_ll_slot_t *s = &ll->slots[slot];
    int world = buffer->group->world_size, me = buffer->group->rank;
    int num_local = buffer->num_local_experts, k = buffer->config.num_topk;
    size_t row_bytes = (size_t)buffer->config.hidden * 2;
    uint64_t seq = ++s->combine_seq;
    s->topk_idx = args->topk_idx;
    s->topk_weights = args->topk_weights;
    s->out = args->out;
    s->combine_wait_stats = args->wait_recv_cost_stats.data;
    s->combine_wait_start = epx__host_ll_wait_start(s->combine_wait_stats, args->flags);
    for (int r = 0; r < world; r++)
        s->peers[r] = !ll->mask[r];

    epx_status_t peer_status =
        epx__host_ll_wait(ll, me, world, EPX__LL_FLAG_COMBINE_DONE, slot, seq - 1,
                          "ll_combine (waiting for home ranks to release the slot)", s, 0,
                          NULL);

    const char *base = epx__host_ll_slot(ll, me, slot);
    const int32_t *counts = (const int32_t *)(base + l->recv_count);
    const int32_t *src_rank = (const int32_t *)(base + l->recv_src_rank);
    const int32_t *src_token = (const int32_t *)(base + l->recv_src_info);
    const int32_t *src_topk = (const int32_t *)(base + l->recv_topk);
    for (int local = 0; local < num_local; local++) {
        for (int64_t i = 0; i < counts[local]; i++) {
            int64_t row = (int64_t)local * l->rows + i;
            int home = src_rank[row];
            if (!s->peers[home])
                continue;
            char *stage = epx__host_ll_slot(ll, home, slot) + l->combine_stage;
            int64_t cell = (int64_t)src_token[row] * k + src_topk[row];
            memcpy(stage + (size_t)cell * row_bytes,
                   (const char *)args->x.data + (size_t)row * row_bytes, row_bytes);
        }
    }
    for (int r = 0; r < world; r++)
        if (s->peers[r])
            epx__shm_flag_store(epx__host_ll_flag(ll, r, EPX__LL_FLAG_COMBINE, slot, me), seq);
    return peer_status;
}

epx_status_t epx__host_ll_combine_receive(epx_buffer_t buffer, int slot,
                                          epx_ll_combine_result_t *result, void *stream)
{
    (void)stream;
    epx__host_ll_t *ll = epx__host_ll_of(buffer);
    const epx__host_ll_layout_t *l = &ll->layout;
    epx__host_ll_slot_t *s = &ll->slots[slot];
    int world = buffer->group->world_size, me = buffer->group->rank;
    int num_local = buffer->num_local_experts, k = buffer->config.num_topk;
    int64_t hidden = buffer->config.hidden;
    epx_status_t peer_status = epx__host_ll_wait(
        ll, me, world, EPX__LL_FLAG_COMBINE, slot, s->combine_seq,
        "ll_combine (waiting for expert outputs)", s, s->combine_wait_start, s->combine_wait_stats);

    const uint16_t *stage = (const uint16_t *)(epx__host_ll_slot(ll, me, slot) + l->combine_stage);
    int64_t idx_stride = epx__tensor_row_stride(&s->topk_idx);
    int64_t weight_stride = epx__tensor_row_stride(&s->topk_weights);
    int64_t out_stride = epx__tensor_row_stride(&s->out);
    int64_t masked = 0;
    float *acc = ll->accumulator;
    for (int64_t t = 0; t < s->num_tokens; t++) {
        const int64_t *idx = (const int64_t *)s->topk_idx.data + t * idx_stride;
        const float *weights = (const float *)s->topk_weights.data + t * weight_stride;
        for (int64_t h = 0; h < hidden; h++)
            acc[h] = 0.0f;
        for (int j = 0; j < k; j++) {
            int64_t e = idx[j];
            if (e < 0)
                continue;
            if (!s->peers[e / num_local]) {
                masked++;
                continue;
            }
            int first = 0;
            while (idx[first] != e)
                first++;
            const uint16_t *y = stage + ((size_t)t * (size_t)k + (size_t)first) * (size_t)hidden;
            float w = weights[j];
            for (int64_t h = 0; h < hidden; h++)
                acc[h] = fmaf(w, epx__bf16_to_float(y[h]), acc[h]);
        }
        uint16_t *out = (uint16_t *)s->out.data + t * out_stride;
        for (int64_t h = 0; h < hidden; h++)
            out[h] = epx__float_to_bf16(acc[h]);
    }
    epx__host_ll_release(ll, s, me, world, EPX__LL_FLAG_COMBINE_DONE, slot, s->combine_seq);
    if (result != NULL)
        result->num_masked_entries = masked;
    return peer_status;
}
