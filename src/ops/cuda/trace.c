/*
 * The normal-mode combine's phase trace (EPX_NORMAL_TRACE=<prefix>, developers): device
 * memory the combine kernels stamp (layout in launch.h, stamps in combine.cu), written to
 * <prefix>.<rank> when the buffer is destroyed; scripts/normal-trace prints where a
 * combine's time went (docs/PERFORMANCE.md, "Where combine's time goes beyond its row
 * loop"). One node only: the internode combine kernels record nothing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/cuda_backend.h"

epx_status_t epx__cuda_trace_create(epx__cuda_buffer_t *cuda)
{
    epx__cuda_shape_t *s = &cuda->shape;
    if (s->num_nodes > 1 || epx__param_string(EPX_PARAM_NORMAL_TRACE)[0] == '\0')
        return EPX_SUCCESS;
    size_t bytes = EPX_NORMAL_TRACE_WORDS * sizeof(uint64_t);
    EPX_CUDA_CHECK(cudaMalloc((void **)&s->trace, bytes),
                   "buffer_create: cudaMalloc of %zu bytes (EPX_NORMAL_TRACE)", bytes);
    EPX_CUDA_CHECK(cudaMemset(s->trace, 0, bytes), "buffer_create: zeroing the trace");
    return EPX_SUCCESS;
}

/*
 * <prefix>.<rank>: a header of 8 int64 (magic "EPXNMTR1" as bytes, rank, world, calls
 * a ring holds, events, 0, 0, 0), then the trace's words. Best effort: a failure is
 * logged, never an error.
 */
static void write_trace(const epx__cuda_shape_t *s)
{
    uint64_t *host = malloc(EPX_NORMAL_TRACE_WORDS * sizeof(uint64_t));
    char path[1100];
    snprintf(path, sizeof(path), "%s.%d", epx__param_string(EPX_PARAM_NORMAL_TRACE), s->rank);
    FILE *file = NULL;
    if (host != NULL && cudaDeviceSynchronize() == cudaSuccess &&
        cudaMemcpy(host, s->trace, EPX_NORMAL_TRACE_WORDS * sizeof(uint64_t),
                   cudaMemcpyDeviceToHost) == cudaSuccess)
        file = fopen(path, "wb");
    if (file != NULL) {
        int64_t header[8] = {0, s->rank, s->world_size, EPX_NORMAL_TRACE_CALLS,
                             EPX_NORMAL_TRACE_EVENTS, 0, 0, 0};
        memcpy(&header[0], "EPXNMTR1", 8);
        if (fwrite(header, sizeof(header), 1, file) != 1 ||
            fwrite(host, sizeof(uint64_t), EPX_NORMAL_TRACE_WORDS, file) != EPX_NORMAL_TRACE_WORDS)
            EPX_WARN(EPX_SUBSYS_OPS, "EPX_NORMAL_TRACE: writing %s failed", path);
        fclose(file);
        EPX_INFO(EPX_SUBSYS_OPS, "EPX_NORMAL_TRACE: wrote %s", path);
    } else {
        EPX_WARN(EPX_SUBSYS_OPS, "EPX_NORMAL_TRACE: could not write %s", path);
    }
    free(host);
}

void epx__cuda_trace_release(epx__cuda_buffer_t *cuda, int write)
{
    epx__cuda_shape_t *s = &cuda->shape;
    if (s->trace == NULL)
        return;
    if (write)
        write_trace(s);
    (void)cudaFree(s->trace);
    s->trace = NULL;
}
