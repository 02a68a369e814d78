/*
 * epx_buffer_register on the CUDA backend: every rank maps each peer's range over CUDA
 * IPC (transport/cuda_ipc, the peers this rank reaches by CUDA IPC: all on one node,
 * this node's across nodes) and writes the mapped addresses into its device state
 * (epx__cuda_local_t.registered), where the combine kernels look up a peer's x when the
 * peer published a registered range (combine.c, signal.cuh epx_peer_x).
 */
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/cuda_backend.h"
#include "ops/group.h"

_Static_assert(EPX_CUDA_MAX_REGISTERED == EPX_MAX_REGISTERED,
               "the device table holds every registered range");

/* This rank's device table row `row`: the mapped ranges, or NULLs. Callers make sure
 * no kernel reads the row while it changes (the device idle, or the row unused). The
 * write has landed on return: a copy from pageable memory may return before its DMA
 * ends, and a later write of the same row on a non-blocking stream (a combine mapping
 * x on demand) is not ordered after it. */
epx_status_t epx__cuda_write_range_row(epx__cuda_buffer_t *cuda, int row, char *const *peers)
{
    char *table[EPX_CUDA_MAX_RANKS];
    memset(table, 0, sizeof(table));
    for (int r = 0; peers != NULL && r < cuda->shape.world_size; r++)
        table[r] = peers[r];
    EPX_CUDA_CHECK(cudaMemcpy(cuda->local->registered[row], table, sizeof(table),
                              cudaMemcpyHostToDevice),
                   "writing the device table of ranges read in place");
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "writing the device table of ranges read in place");
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_register_range(epx_buffer_t buffer, int slot)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx_group_t group = buffer->group;
    int R = group->world_size;
    epx_status_t status = EPX_SUCCESS;
    int *reach = calloc((size_t)R, sizeof(int));
    if (reach == NULL)
        status = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_register: out of host memory");
    for (int r = 0; reach != NULL && r < R; r++)
        reach[r] = r != group->rank && cuda->peer_bases[r] != NULL;
    cudaError_t err = cudaSetDevice(group->device);
    if (status == EPX_SUCCESS && err != cudaSuccess)
        status = EPX_CUDA_ERROR(err, "buffer_register: cudaSetDevice(%d)", group->device);
    status = epx__cuda_auto_purge(buffer, status);
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    epx__cuda_ipc_range_t *range = NULL;
    status = epx__cuda_ipc_range_map(&ranks, &cuda->ipc_cache, buffer->registered[slot].ptr,
                                     buffer->registered[slot].bytes, reach, status,
                                     "buffer_register", &range);
    free(reach);
    if (status == EPX_SUCCESS) {
        err = cudaDeviceSynchronize();
        status = err != cudaSuccess
                     ? EPX_CUDA_ERROR(err, "buffer_register: waiting for queued work")
                     : epx__cuda_write_range_row(cuda, slot, range->peers);
        /* Every rank's table is written before any rank's combine may name the range. */
        status = epx__cuda_vote(group, status, "buffer_register", "could not record the ranges");
    }
    if (status != EPX_SUCCESS) {
        if (range != NULL)
            (void)epx__cuda_write_range_row(cuda, slot, NULL);
        epx__cuda_ipc_range_unmap(&cuda->ipc_cache, range);
        return status;
    }
    cuda->registered[slot] = range;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_unregister_range(epx_buffer_t buffer, int slot)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx_group_t group = buffer->group;
    (void)cudaSetDevice(group->device);
    /* This rank's queued combines may still read the peers' ranges; and a peer may still
     * read this rank's until it is done too: the vote below. */
    cudaError_t err = cudaDeviceSynchronize();
    epx_status_t status =
        err != cudaSuccess ? EPX_CUDA_ERROR(err, "buffer_deregister: waiting for queued work")
                           : epx__cuda_write_range_row(cuda, slot, NULL);
    status = epx__cuda_vote(group, status, "buffer_deregister", "failed");
    epx__cuda_ipc_range_unmap(&cuda->ipc_cache, cuda->registered[slot]);
    cuda->registered[slot] = NULL;
    return status;
}

void epx__cuda_release_ranges(epx__cuda_buffer_t *cuda)
{
    epx__cuda_auto_release(cuda);
    for (int i = 0; i < EPX_CUDA_MAX_REGISTERED; i++) {
        epx__cuda_ipc_range_unmap(&cuda->ipc_cache, cuda->registered[i]);
        cuda->registered[i] = NULL;
    }
}
