/*
 * Out-of-band rendezvous between ranks: a small allgather and a barrier, used to set
 * up groups and buffers (exchange shared-memory names, IPC handles, NVSHMEM ids).
 * Not on the data path. Two implementations: TCP through rank 0 (standalone
 * programs, epx launch) and caller-supplied callbacks (frameworks).
 */
#ifndef EPX_BOOTSTRAP_H
#define EPX_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

typedef struct epx__bootstrap epx__bootstrap_t;

/*
 * Collective. Rank 0 listens on the id's address and port; the others connect (retrying
 * until timeout_ms) and present the id's nonce. Errors name the rank that is missing.
 */
epx_status_t epx__bootstrap_create_tcp(const epx_unique_id_t *id, int rank, int world_size,
                                       int64_t timeout_ms, epx__bootstrap_t **bootstrap);
/* Wraps the caller's callbacks (copied; ctx must outlive the bootstrap). */
epx_status_t epx__bootstrap_create_callbacks(const epx_bootstrap_callbacks_t *callbacks,
                                             int rank, int world_size,
                                             epx__bootstrap_t **bootstrap);
/* recv receives world_size * bytes; rank i's `send` lands at offset i * bytes. */
epx_status_t epx__bootstrap_allgather(epx__bootstrap_t *bootstrap, const void *send,
                                      void *recv, size_t bytes);
epx_status_t epx__bootstrap_barrier(epx__bootstrap_t *bootstrap);
void epx__bootstrap_destroy(epx__bootstrap_t *bootstrap);

#endif /* EPX_BOOTSTRAP_H */
