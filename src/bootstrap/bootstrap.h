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

/*
 * The status vote every collective set-up step ends with (src/bootstrap/vote.c): each
 * rank's record (`bytes`, starting with an int32 status that this call sets to `local`)
 * is gathered into `all` ([world_size] records), and every rank returns the same kind of
 * answer: its own failure `local` (with the message it had before the vote), else the
 * bootstrap's failure, else EPX_ERR_REMOTE "<op>: rank r <what> (<status>)" naming the
 * first rank whose record failed, else EPX_SUCCESS. A rank that already failed still
 * votes, so its peers learn about it instead of waiting.
 */
epx_status_t epx__bootstrap_vote(epx__bootstrap_t *bootstrap, int world_size, epx_status_t local,
                                 void *mine, void *all, size_t bytes, const char *op,
                                 const char *what);
void epx__bootstrap_destroy(epx__bootstrap_t *bootstrap);

#endif /* EPX_BOOTSTRAP_H */
