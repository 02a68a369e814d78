/*
 * Peer device memory over CUDA IPC (see ipc.h).
 */
#include "transport/cuda_ipc/ipc.h"

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "transport/cuda_status.h"

/* What each rank contributes to an allgather step: its status and its handle. */
typedef struct {
    int32_t status;
    int32_t device;
    cudaIpcMemHandle_t handle;
} ipc_vote_t;

/* Every rank learns every rank's status; the first failing rank is named. */
static epx_status_t gather_votes(const epx__transport_ranks_t *group, epx_status_t local,
                                 ipc_vote_t *mine, ipc_vote_t *all, const char *step)
{
    return epx__bootstrap_vote(group->bootstrap, group->world_size, local, mine, all,
                               sizeof(*mine), "buffer_create", step);
}

/* This rank's region, zeroed, and its IPC handle. */
static epx_status_t allocate_region(epx__cuda_ipc_t *ipc, ipc_vote_t *vote)
{
    EPX_CUDA_CHECK(cudaMalloc(&ipc->local, ipc->bytes),
                   "buffer_create: cudaMalloc of %zu bytes for the communication buffer",
                   ipc->bytes);
    EPX_CUDA_CHECK(cudaMemset(ipc->local, 0, ipc->bytes), "buffer_create: zeroing the buffer");
    /* Peers signal into this memory as soon as they have mapped it: zero it first. */
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "buffer_create: waiting for the zeroing");
    EPX_CUDA_CHECK(cudaIpcGetMemHandle(&vote->handle, ipc->local),
                   "buffer_create: cudaIpcGetMemHandle");
    return EPX_SUCCESS;
}

static epx_status_t open_peers(epx__cuda_ipc_t *ipc, const ipc_vote_t *votes)
{
    for (int r = 0; r < ipc->world_size; r++) {
        if (r == ipc->rank) {
            ipc->peers[r] = ipc->local;
            continue;
        }
        void *mapped = NULL;
        cudaError_t err =
            cudaIpcOpenMemHandle(&mapped, votes[r].handle, cudaIpcMemLazyEnablePeerAccess);
        if (err != cudaSuccess)
            return EPX_CUDA_ERROR(err,
                                  "buffer_create: opening rank %d's buffer (device %d) with "
                                  "cudaIpcOpenMemHandle",
                                  r, votes[r].device);
        ipc->peers[r] = mapped;
    }
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_ipc_create(const epx__transport_ranks_t *group, size_t bytes,
                                  epx_status_t local_status, epx__cuda_ipc_t **out)
{
    int world = group->world_size;
    epx__cuda_ipc_t *ipc = calloc(1, sizeof(*ipc));
    ipc_vote_t *votes = calloc((size_t)world, sizeof(*votes));
    ipc_vote_t *results = calloc((size_t)world, sizeof(*results));
    char **peers = calloc((size_t)world, sizeof(char *));
    if (ipc == NULL || votes == NULL || results == NULL || peers == NULL) {
        free(ipc);
        free(votes);
        free(results);
        free(peers);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of host memory");
    }
    ipc->rank = group->rank;
    ipc->world_size = world;
    ipc->bytes = bytes;
    ipc->peers = peers;

    ipc_vote_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.device = group->device;
    epx_status_t status = local_status != EPX_SUCCESS ? local_status : allocate_region(ipc, &mine);
    status = gather_votes(group, status, &mine, votes, "failed to allocate its buffer");
    if (status == EPX_SUCCESS) {
        ipc_vote_t opened;
        memset(&opened, 0, sizeof(opened));
        opened.device = group->device;
        status = gather_votes(group, open_peers(ipc, votes), &opened, results,
                              "failed to map its peers' buffers");
    }
    free(votes);
    free(results);
    if (status != EPX_SUCCESS) {
        epx__cuda_ipc_destroy(ipc);
        return status;
    }
    *out = ipc;
    return EPX_SUCCESS;
}

void epx__cuda_ipc_destroy(epx__cuda_ipc_t *ipc)
{
    if (ipc == NULL)
        return;
    if (ipc->peers != NULL) {
        for (int r = 0; r < ipc->world_size; r++)
            if (r != ipc->rank && ipc->peers[r] != NULL)
                (void)cudaIpcCloseMemHandle(ipc->peers[r]);
        free(ipc->peers);
    }
    if (ipc->local != NULL)
        (void)cudaFree(ipc->local);
    (void)cudaGetLastError();
    free(ipc);
}
