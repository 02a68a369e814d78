/*
 * The normal-mode combine's phase trace (EPX_NORMAL_TRACE=<prefix>, developers): device
 * memory the combine kernels stamp (layout in launch.h, stamps in combine.cu), written to
 * <prefix>.<rank> when the buffer is destroyed; scripts/normal-trace prints where a
 * combine's time went (docs/PERFORMANCE.md, "Where combine's time goes beyond its row
 * loop"). One node only: the internode combine kernels record nothing. The file writer
 * serves the low-latency trace (EPX_LL_TRACE, ll_setup.c) as well.
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

void epx__cuda_trace_write(const char *variable, const char *prefix, int rank,
                           const char magic[8], const int64_t fields[7], const uint64_t *trace,
                           size_t words)
{
    uint64_t *host = malloc(words * sizeof(uint64_t));
    char path[1100];
    snprintf(path, sizeof(path), "%s.%d", prefix, rank);
    FILE *file = NULL;
    if (host != NULL &&
        cudaMemcpy(host, trace, words * sizeof(uint64_t), cudaMemcpyDeviceToHost) == cudaSuccess)
        file = fopen(path, "wb");
    if (file != NULL) {
        int64_t header[8];
        memcpy(&header[0], magic, 8);
        memcpy(&header[1], fields, 7 * sizeof(int64_t));
        if (fwrite(header, sizeof(header), 1, file) != 1 ||
            fwrite(host, sizeof(uint64_t), words, file) != words)
            EPX_WARN(EPX_SUBSYS_OPS, "%s: writing %s failed", variable, path);
        fclose(file);
        EPX_INFO(EPX_SUBSYS_OPS, "%s: wrote %s", variable, path);
    } else {
        EPX_WARN(EPX_SUBSYS_OPS, "%s: could not write %s", variable, path);
    }
    free(host);
}

void epx__cuda_trace_release(epx__cuda_buffer_t *cuda, int write)
{
    epx__cuda_shape_t *s = &cuda->shape;
    if (s->trace == NULL)
        return;
    /* Header: magic "EPXNMTR1", rank, world, calls a ring holds, events, 0, 0, 0. */
    const int64_t fields[7] = {s->rank, s->world_size, EPX_NORMAL_TRACE_CALLS,
                               EPX_NORMAL_TRACE_EVENTS, 0, 0, 0};
    if (write && cudaDeviceSynchronize() == cudaSuccess)
        epx__cuda_trace_write("EPX_NORMAL_TRACE", epx__param_string(EPX_PARAM_NORMAL_TRACE),
                              s->rank, "EPXNMTR1", fields, s->trace, EPX_NORMAL_TRACE_WORDS);
    (void)cudaFree(s->trace);
    s->trace = NULL;
}
