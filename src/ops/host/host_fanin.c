/*
 * epx_fanin_reduce on the CPU backend (include/epx_tool.h): each output row the fp32 sum
 * of its source rows, read from the ranks' combine-input regions (staging x) through the
 * shared-memory mapping the normal-mode operations use, added in the header's order and
 * rounded to bf16 like the CUDA kernel (bf16.h). Synchronous: done on return.
 */
#include <stdint.h>

#include "ops/host/bf16.h"
#include "ops/host/host.h"

/* Elements summed at a time: the sums of one piece of a row stay in a small array on the
 * stack while every source row's piece is added, so no row-sized allocation can fail. */
#define FANIN_PIECE 256

epx_status_t epx__host_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args,
                                    void *stream)
{
    (void)stream;
    epx__host_buffer_t *host = buffer->impl;
    const int R = buffer->group->world_size, me = buffer->group->rank;
    const int64_t pitch = buffer->config.hidden * 2;
    const int64_t first_row = (int64_t)me * buffer->config.max_tokens_per_rank;
    const int64_t milli = epx__fanout_milli(args->fanin);
    const int64_t elements = args->row_bytes / 2;
    float sums[FANIN_PIECE];
    for (int64_t i = 0; i < args->rows; i++) {
        const int count = epx__fanout_count(i, milli);
        uint16_t *out = (uint16_t *)((char *)args->dst + i * args->dst_pitch);
        for (int64_t e0 = 0; e0 < elements; e0 += FANIN_PIECE) {
            const int64_t n = elements - e0 < FANIN_PIECE ? elements - e0 : FANIN_PIECE;
            for (int64_t e = 0; e < n; e++)
                sums[e] = 0.0f;
            for (int j = 0; j < count; j++) {
                const int r = (int)((me + i + j) % R);
                const char *region = epx__host_region(host, r, host->layout.stage_x);
                const uint16_t *src = (const uint16_t *)(region + (first_row + i) * pitch) + e0;
                for (int64_t e = 0; e < n; e++)
                    sums[e] += epx__bf16_to_float(src[e]);
            }
            for (int64_t e = 0; e < n; e++)
                out[e0 + e] = epx__float_to_bf16(sums[e]);
        }
    }
    return EPX_SUCCESS;
}
