/*
 * The host backend's low-latency memory (layout in host_ll.h), its masks and its waits.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ops/host/host.h"
#include "ops/host/host_ll.h"

/* Place count * element bytes at the next 64-byte boundary; nonzero on overflow. */
static int epx__ll_place(size_t *cursor, size_t *offset, int64_t count, size_t element)
{
    size_t bytes;
    size_t start = (*cursor + 63) / 64 * 64;
    if (count < 0 || start < *cursor || __builtin_mul_overflow((size_t)count, element, &bytes) ||
        __builtin_add_overflow(start, bytes, cursor))
        return 1;
    *offset = start;
    return 0;
}

epx_status_t epx__host_ll_layout(int world_size, const epx_buffer_config_t *config,
                                 epx__host_ll_layout_t *layout)
{
    epx__host_ll_layout_t l;
    memset(&l, 0, sizeof(l));
    int64_t m = config->max_low_latency_tokens, hidden = config->hidden;
    int64_t num_local = config->num_experts / world_size, k = config->num_topk;
    l.max_tokens = m;
    l.rows = m * world_size;
    l.scale_cols = hidden % EPX__FP8_BLOCK == 0 ? hidden / EPX__FP8_BLOCK : 0;
    /* Dispatch rows: room for bf16 unless the buffer was made for fp8 dispatch only. */
    int fp8_only = config->low_latency_dtype == EPX_DTYPE_FP8_E4M3;
    l.x_row_bytes = (size_t)hidden * (fp8_only ? 1 : 2);
    int64_t staged = num_local * l.rows; /* [L][R][M] == [L][M*R] cells */
    int64_t x_cells, bf16_cells, scale_cells, combine_cells;
    int failed = __builtin_mul_overflow(staged, (int64_t)l.x_row_bytes, &x_cells) ||
                 __builtin_mul_overflow(staged, hidden * 2, &bf16_cells) ||
                 __builtin_mul_overflow(staged, l.scale_cols, &scale_cells) ||
                 __builtin_mul_overflow(m * k, hidden * 2, &combine_cells);
    size_t cursor = 0, slot_cursor = 0, unused;
    failed = failed || epx__ll_place(&cursor, &l.flags, 8 * (int64_t)world_size, sizeof(uint64_t));
    /* Offsets inside one slot, then two slots after the flags. */
    failed = failed || epx__ll_place(&slot_cursor, &l.stage_count, num_local * world_size, 4) ||
             epx__ll_place(&slot_cursor, &l.stage_x, x_cells, 1) ||
             epx__ll_place(&slot_cursor, &l.stage_scales, scale_cells, sizeof(float)) ||
             epx__ll_place(&slot_cursor, &l.stage_token, staged, 4) ||
             epx__ll_place(&slot_cursor, &l.stage_topk, staged, 4) ||
             epx__ll_place(&slot_cursor, &l.recv_x, x_cells, 1) ||
             epx__ll_place(&slot_cursor, &l.recv_scales, scale_cells, sizeof(float)) ||
             epx__ll_place(&slot_cursor, &l.recv_count, num_local, 4) ||
             epx__ll_place(&slot_cursor, &l.recv_src_info, staged, 4) ||
             epx__ll_place(&slot_cursor, &l.recv_range, num_local * world_size, 8) ||
             epx__ll_place(&slot_cursor, &l.recv_src_rank, staged, 4) ||
             epx__ll_place(&slot_cursor, &l.recv_topk, staged, 4) ||
             epx__ll_place(&slot_cursor, &l.combine_in, bf16_cells, 1) ||
             epx__ll_place(&slot_cursor, &l.combine_stage, combine_cells, 1) ||
             epx__ll_place(&cursor, &l.slot[0], (int64_t)slot_cursor, 1) ||
             epx__ll_place(&cursor, &l.slot[1], (int64_t)slot_cursor, 1) ||
             epx__ll_place(&cursor, &unused, 0, 1);
    if (failed)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: max_low_latency_tokens %" PRId64 " x %d ranks x hidden %" PRId64
                         " does not fit in memory sizes",
                         m, world_size, hidden);
    l.total = (cursor + 63) / 64 * 64;
    *layout = l;
    return EPX_SUCCESS;
}

void epx__host_ll_destroy(epx__host_ll_t *ll)
{
    if (ll == NULL)
        return;
    epx__shm_destroy(ll->shm);
    for (int b = 0; b < 2; b++) {
        free(ll->slots[b].peers);
        free(ll->slots[b].failed);
    }
    free(ll->mask);
    free(ll->send_counts);
    free(ll->cast_row);
    free(ll->cast_scales);
    free(ll->accumulator);
    free(ll->wait_flags);
    free(ll->arrived_ns);
    free(ll);
}

epx_status_t epx__host_ll_alloc(epx_buffer_t buffer, epx__host_ll_t **out)
{
    epx_group_t group = buffer->group;
    const epx_buffer_config_t *config = &buffer->config;
    size_t world = (size_t)group->world_size, hidden = (size_t)config->hidden;
    epx__host_ll_layout_t layout;
    EPX_CHECK(epx__host_ll_layout(group->world_size, config, &layout));
    epx__host_ll_t *ll = calloc(1, sizeof(*ll));
    int failed = ll == NULL;
    if (!failed) {
        ll->layout = layout;
        ll->mask = calloc(world, 1);
        ll->send_counts = calloc((size_t)config->num_experts, sizeof(int32_t));
        ll->cast_row = malloc(hidden);
        ll->cast_scales = malloc((hidden / EPX__FP8_BLOCK + 1) * sizeof(float));
        ll->accumulator = malloc(hidden * sizeof(float));
        ll->wait_flags = calloc(world, sizeof(uint64_t *));
        ll->arrived_ns = calloc(world, sizeof(int64_t));
        failed = ll->mask == NULL || ll->send_counts == NULL || ll->cast_row == NULL ||
                 ll->cast_scales == NULL || ll->accumulator == NULL || ll->wait_flags == NULL ||
                 ll->arrived_ns == NULL;
        for (int b = 0; b < 2 && !failed; b++) {
            ll->slots[b].peers = calloc(world, 1);
            ll->slots[b].failed = calloc(world, 1);
            failed = ll->slots[b].peers == NULL || ll->slots[b].failed == NULL;
        }
    }
    if (failed) {
        epx__host_ll_destroy(ll);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY,
                         "buffer: no host memory for rank %d's low-latency scratch", group->rank);
    }
    *out = ll;
    return EPX_SUCCESS;
}

epx_status_t epx__host_ll_create(epx_buffer_t buffer, epx__host_ll_t **out)
{
    epx__host_ll_t *ll = NULL;
    EPX_CHECK(epx__host_ll_alloc(buffer, &ll));
    epx__transport_ranks_t ranks = epx__group_ranks(buffer->group);
    epx_status_t status = epx__shm_create(&ranks, ll->layout.total, &ll->shm);
    if (status != EPX_SUCCESS) {
        ll->shm = NULL;
        epx__host_ll_destroy(ll);
        return status;
    }
    EPX_DEBUG(EPX_SUBSYS_OPS, "host low-latency buffer: %zu bytes per rank", ll->layout.total);
    *out = ll;
    return EPX_SUCCESS;
}

epx_status_t epx__host_ll_wait(epx__host_ll_t *ll, int rank, int world, int kind, int slot,
                               uint64_t target, const char *stage, epx__host_ll_slot_t *s,
                               int64_t start, int64_t *stats)
{
    if (stats != NULL && start == 0)
        start = epx__now_ns();
    uint8_t *peers = s->peers;
    for (int r = 0; r < world; r++) {
        peers[r] = peers[r] && !ll->mask[r];
        ll->wait_flags[r] = peers[r] ? epx__host_ll_flag(ll, rank, kind, slot, r) : NULL;
        s->failed[r] = 0;
    }
    epx_status_t status = epx__shm_wait_flags(ll->shm, stage, ll->wait_flags, target, s->failed,
                                              stats != NULL ? ll->arrived_ns : NULL);
    for (int r = 0; r < world; r++) {
        if (!s->failed[r])
            continue;
        /* A lost peer: leave it out of this step and of every later call. */
        peers[r] = 0;
        ll->mask[r] = 1;
        EPX_WARN(EPX_SUBSYS_OPS, "low-latency: rank %d masked after a failed wait (%s)", r, stage);
    }
    for (int r = 0; r < world && stats != NULL; r++)
        if (peers[r] && ll->arrived_ns[r] >= 0)
            stats[r] += ll->arrived_ns[r] - start;
    return status;
}

void epx__host_ll_release(epx__host_ll_t *ll, const epx__host_ll_slot_t *s, int rank, int world,
                          int kind, int slot, uint64_t seq)
{
    for (int r = 0; r < world; r++)
        if (s->peers[r] || s->failed[r])
            epx__shm_flag_store(epx__host_ll_flag(ll, r, kind, slot, rank), seq);
}

epx_status_t epx__host_ll_combine_buffer(epx_buffer_t buffer, int slot, void **base)
{
    epx__host_ll_t *ll = epx__host_ll_of(buffer);
    *base = epx__host_ll_slot(ll, buffer->group->rank, slot) + ll->layout.combine_in;
    return EPX_SUCCESS;
}

epx_status_t epx__host_ll_mask_rank(epx_buffer_t buffer, int rank)
{
    epx__host_ll_of(buffer)->mask[rank] = 1;
    return EPX_SUCCESS;
}

void epx__host_ll_get_masked(epx_buffer_t buffer, int32_t *mask)
{
    epx__host_ll_t *ll = epx__host_ll_of(buffer);
    for (int r = 0; r < buffer->group->world_size; r++)
        mask[r] = ll->mask[r];
}
