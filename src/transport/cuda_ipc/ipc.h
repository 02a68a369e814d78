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
#include <stdint.h>

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

/*
 * Caller memory mapped by the peers (epx_buffer_register): each rank passes a range of
 * one cudaMalloc allocation of its own; the ranks exchange the allocation's IPC handle
 * and the range's offset in it, and each rank opens the handles of the ranks it is told
 * to reach. A cache per set of ranges opens an allocation once however many ranges lie
 * in it (a caching allocator packs many tensors into one allocation).
 */
typedef struct epx__cuda_ipc_opened epx__cuda_ipc_opened_t;
typedef struct {
    epx__cuda_ipc_opened_t *head; /* zero-initialise */
} epx__cuda_ipc_cache_t;

typedef struct {
    int world_size;
    char **peers;                      /* [R] each rank's range as mapped here (NULL: not
                                          reached); peers[rank] = the caller's ptr */
    epx__cuda_ipc_opened_t **opened;   /* [R] what peers[r] holds open, to release */
} epx__cuda_ipc_range_t;

/*
 * Collective over `ranks` (ranks->device current): `reach[r]` nonzero maps rank r's
 * range (ignored for this rank). A rank with nothing to offer passes `bytes` 0 (its
 * entry stays NULL everywhere). A rank that already failed passes `local_status`. `op`
 * names the call in messages ("buffer_register").
 * Every rank returns the same kind of answer; nothing stays opened on failure.
 */
epx_status_t epx__cuda_ipc_range_map(const epx__transport_ranks_t *ranks, epx__cuda_ipc_cache_t *cache,
                                     void *ptr, size_t bytes, const int *reach,
                                     epx_status_t local_status, const char *op,
                                     epx__cuda_ipc_range_t **range);
/* The device allocation holding `ptr`: its start, size and the driver's id for it
 * (CU_POINTER_ATTRIBUTE_BUFFER_ID, never reused: tells a new allocation at an old
 * address apart). Local; an error for memory that is not a device allocation, its
 * message starting with `op`. */
typedef struct {
    uintptr_t base;
    size_t bytes;
    unsigned long long id;
} epx__cuda_ipc_allocation_t;
epx_status_t epx__cuda_ipc_allocation(const char *op, const void *ptr,
                                      epx__cuda_ipc_allocation_t *allocation);
/* The same without an error: 1 found, 0 not a device allocation (freed, or never one). */
int epx__cuda_ipc_find_allocation(const void *ptr, epx__cuda_ipc_allocation_t *allocation);
/* Whether the allocation starting at `base` has a CUDA IPC handle (cudaMalloc memory
 * does; cudaMallocAsync and VMM memory do not). Local. */
int epx__cuda_ipc_exportable(uintptr_t base);

/* Local: release the range's mappings (an allocation is closed with its last range).
 * Callers make sure no kernel of this rank still reads them. NULL is a no-op. */
void epx__cuda_ipc_range_unmap(epx__cuda_ipc_cache_t *cache, epx__cuda_ipc_range_t *range);

#endif /* EPX_TRANSPORT_CUDA_IPC_H */
