/*
 * epx_fanout_copy on the CPU backend (include/epx_tool.h): each source row copied with
 * memcpy into the combine-input region (staging x) of every rank it goes to, through the
 * shared-memory mapping the normal-mode operations use. Synchronous: done on return.
 */
#include <string.h>

#include "ops/host/host.h"

epx_status_t epx__host_fanout_copy(epx_buffer_t buffer, const epx_fanout_args_t *args,
                                   void *stream)
{
    (void)stream;
    epx__host_buffer_t *host = buffer->impl;
    const int R = buffer->group->world_size, me = buffer->group->rank;
    const int64_t pitch = buffer->config.hidden * 2;
    const int64_t first_row = (int64_t)me * buffer->config.max_tokens_per_rank;
    const int64_t milli = epx__fanout_milli(args->fanout);
    for (int64_t i = 0; i < args->rows; i++) {
        const char *src = (const char *)args->src + i * args->src_pitch;
        const int count = epx__fanout_count(i, milli);
        for (int j = 0; j < count; j++) {
            int r = (int)((me + i + j) % R);
            char *dst = epx__host_region(host, r, host->layout.stage_x);
            memcpy(dst + (first_row + i) * pitch, src, (size_t)args->row_bytes);
        }
    }
    return EPX_SUCCESS;
}
