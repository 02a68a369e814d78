/*
 * Peer device memory over CUDA IPC: one allocation per rank, mapped by every rank of
 * the node (NVLink peers, or processes sharing one GPU under MPS).
 *
 * Each rank cudaMalloc's its region and zeroes it, the ranks exchange cudaIpcMemHandle
 * values through the group's bootstrap, and each rank opens every peer's handle. Both
 * steps end with an allgather of every rank's status, so a failure anywhere (out of
 * memory, a handle that does not open) makes every rank return an error naming the
 * rank, with nothing left allocated or mapped.
 */
#ifndef EPX_TRANSPORT_CUDA_IPC_H
#define EPX_TRANSPORT_CUDA_IPC_H

#include <stddef.h>

#include "core/core.h"
#include "transport/transport.h"

typedef struct {
    int rank;
    int world_size;
    size_t bytes;  /* of every rank's region */
    void *local;   /* this rank's region (device memory) */
    char **peers;  /* [world_size] every region as mapped here; peers[rank] = local */
} epx__cuda_ipc_t;

/*
 * Collective over ranks->bootstrap, with ranks->device current. Every rank of the
 * group must be in this node's IPC domain. The region is zeroed and the zeroing has
 * completed on every rank when this returns. A rank that already failed passes its
 * status as `local_status`: it still takes part, so every rank returns an error.
 */
epx_status_t epx__cuda_ipc_create(const epx__transport_ranks_t *ranks, size_t bytes, epx_status_t local_status,
                                  epx__cuda_ipc_t **ipc);
/* Close the peers' mappings and free the region. Local: callers make sure that no
 * peer still uses it (a barrier first). NULL is a no-op. */
void epx__cuda_ipc_destroy(epx__cuda_ipc_t *ipc);

#endif /* EPX_TRANSPORT_CUDA_IPC_H */
