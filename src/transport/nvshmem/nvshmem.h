/*
 * The NVSHMEM transport: the plugin library, NVSHMEM's process-wide set-up and
 * finalisation, symmetric memory and peer pointers. The kernels that move MoE data over
 * it belong to the CUDA backend (src/ops/cuda/ll_*.c, src/ops/cuda/nvshmem/), which
 * finds them in the same plugin through epx__nvshmem_symbol.
 *
 * NVSHMEM is process-wide: the first set-up initialises it with this rank's place among
 * `ranks`, and later set-ups must come from the same rank and world size (the same
 * processes). The owner that set it up (the group) finalises it when destroyed, once
 * every rank's symmetric users are gone and none saw a failed peer (the ranks vote
 * first, with their timeout, so a dead rank cannot hang nvshmem_finalize); otherwise it
 * stays until the process exits. NVSHMEM cannot be set up twice in a process.
 */
#ifndef EPX_TRANSPORT_NVSHMEM_H
#define EPX_TRANSPORT_NVSHMEM_H

#include <stddef.h>

#include "core/core.h"
#include "transport/transport.h"

/*
 * Find and load the plugin (EPX_NVSHMEM_PLUGIN, beside the code of libepx, the build
 * directory): its path and the NVSHMEM version linked into it. Initialises nothing.
 */
epx_status_t epx__nvshmem_probe(const char **path, int version[3]);

/*
 * Collective over `ranks`: load the plugin and initialise NVSHMEM for them unless it is
 * up already; `status` is this rank's state so far (carried into the vote, so every rank
 * fails alike). `sym_bytes`: the symmetric memory the caller is about to allocate
 * (sizes the heap when the user did not). `owner` finalises NVSHMEM when it goes.
 */
epx_status_t epx__nvshmem_setup(const epx__transport_ranks_t *ranks, const void *owner,
                                size_t sym_bytes, epx_status_t status);

/* A symbol of the loaded plugin (the backend's kernel table); NULL when absent. */
void *epx__nvshmem_symbol(const char *name);

/* Symmetric memory: collective on every PE, in the same order (NULL when the heap is
 * too small). Free it only when every peer is known to be alive. */
void *epx__nvshmem_malloc(size_t bytes);
void epx__nvshmem_free(void *p);
/*
 * Count a user of NVSHMEM (a low-latency buffer) from when it is ready until it is gone;
 * `healthy` at the end says that no peer failed while it was in use. NVSHMEM is
 * finalised only with no users left and none that ended unhealthy.
 */
void epx__nvshmem_user_begin(void);
void epx__nvshmem_user_end(int healthy);
/* Peer `pe`'s address of symmetric `p` for direct stores, or NULL (puts needed). */
void *epx__nvshmem_peer(void *p, int pe);

/*
 * `owner` is going away: when it set NVSHMEM up, finalise NVSHMEM if every rank agrees it
 * is safe (collective over `ranks` then; a no-op for any other owner).
 */
void epx__nvshmem_owner_destroyed(const void *owner, const epx__transport_ranks_t *ranks);

#endif /* EPX_TRANSPORT_NVSHMEM_H */
