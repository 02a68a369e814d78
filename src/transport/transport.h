/*
 * What every transport is given about the ranks it connects (src/transport/shm,
 * cuda_ipc, nvshmem). The layers above describe a group with more; a transport needs
 * only this, so it never reads their objects.
 */
#ifndef EPX_TRANSPORT_H
#define EPX_TRANSPORT_H

#include <stdint.h>

#include "bootstrap/bootstrap.h"

typedef struct {
    epx__bootstrap_t *bootstrap; /* the collectives used to set connections up */
    int rank;
    int world_size;
    int device;         /* this rank's CUDA device; -1 for host memory */
    int64_t timeout_ms; /* longest wait for a peer */
} epx__transport_ranks_t;

#endif /* EPX_TRANSPORT_H */
