/*
 * Host shared memory among the ranks of a group (the CPU backend's transport).
 *
 * Every rank owns one shared-memory segment and maps every peer's, so a rank can write
 * straight into a peer's memory. Each segment starts with a control header (the owner's
 * pid, an abort word, an arrival counter) followed by a 4 KiB aligned data area. A
 * segment never has a name: it is an unnamed file in /dev/shm (O_TMPFILE; memfd where
 * that is refused) whose descriptor travels to the peers over a Unix socket, so nothing
 * is ever left in /dev/shm, whenever a rank is killed.
 *
 * Synchronisation is a counting barrier on the headers. Waits never hang: they end
 * with EPX_ERR_REMOTE when a peer published a failure or exited, and with
 * EPX_ERR_TIMEOUT after the group's timeout, naming the ranks and the stage.
 */
#ifndef EPX_TRANSPORT_SHM_H
#define EPX_TRANSPORT_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "core/core.h"
#include "transport/transport.h"

typedef struct epx__shm epx__shm_t;

/*
 * Collective over the ranks' bootstrap: create this rank's segment with a data area of
 * `bytes_per_rank` bytes (zeroed), map every peer's. On failure every rank returns an
 * error and nothing stays mapped or linked.
 */
epx_status_t epx__shm_create(const epx__transport_ranks_t *ranks, size_t bytes_per_rank,
                             epx__shm_t **shm);

/*
 * Wait until every rank has reached the same barrier. Memory written before the barrier
 * by any rank is visible to every rank after it. `stage` names the wait in errors, e.g.
 * "dispatch (waiting for data)".
 */
epx_status_t epx__shm_barrier(epx__shm_t *shm, const char *stage);

/*
 * Publish this rank's failure so that peers waiting in a barrier stop with
 * EPX_ERR_REMOTE (EPX_ERR_TIMEOUT when `status` is a timeout) and this message. The
 * first call wins. A failure that this rank only learned from a peer is published
 * under that peer's rank, so every rank names the one that failed first.
 */
void epx__shm_abort(epx__shm_t *shm, epx_status_t status, const char *message);

/*
 * Without waiting: EPX_SUCCESS, or the failure a peer has published (as a barrier would
 * return it, naming `stage` and the rank that failed first). For a step after a barrier
 * that a peer may have failed after arriving at.
 */
epx_status_t epx__shm_check_failed(epx__shm_t *shm, const char *stage);

/*
 * This rank refuses the collective call it is in, before its first barrier (an argument
 * error found locally, which leaves the buffer usable). A peer waiting for this rank in
 * that barrier stops with EPX_ERR_REMOTE and `message`, unless the peer refused the same
 * call itself: ranks that all refused a call wait for nobody and stay in step (every
 * rank counts its refusals at each barrier, and a peer's refusal counts only if it
 * refused more calls there than this rank did).
 */
void epx__shm_refuse(epx__shm_t *shm, const char *message);

/* Base of the data area of `rank`'s segment (4 KiB aligned), or NULL if out of range. */
void *epx__shm_peer(epx__shm_t *shm, int rank);

/* Bytes of one rank's data area (the size given to epx__shm_create). */
size_t epx__shm_data_bytes(const epx__shm_t *shm);

/* Bytes one rank's segment takes for a data area of `data_bytes` (header included). */
size_t epx__shm_segment_bytes(size_t data_bytes);

/*
 * Sequence flags (src/transport/shm/shm_flag.c), for waits between some ranks only: a writer
 * stores a flag (release) after the data it guards; a reader loads it (acquire).
 */
uint64_t epx__shm_flag_load(const uint64_t *flag);
void epx__shm_flag_store(uint64_t *flag, uint64_t value);

/*
 * Wait until *flags[r] >= target for every rank r with flags[r] != NULL and failed[r]
 * == 0. A rank that published a failure, exited or did not answer within the group's
 * timeout gets failed[r] = 1 and is no longer waited for; the others still are. Returns
 * EPX_SUCCESS, or the first such failure (EPX_ERR_REMOTE / EPX_ERR_TIMEOUT) with a
 * message naming `stage` and the rank, once every other flag has arrived. Optional
 * `arrived_ns` ([world], or NULL): the time (epx__now_ns) at which the wait first saw
 * each flag at the target (its start for a flag already there), -1 for a rank not waited
 * for or failed; the wait then looks at every flag each round (time the low-latency
 * receives, wait_recv_cost_stats).
 */
epx_status_t epx__shm_wait_flags(epx__shm_t *shm, const char *stage, uint64_t *const *flags,
                                 uint64_t target, uint8_t *failed, int64_t *arrived_ns);

/*
 * Rejoin (shm_rejoin.c): collective over `ranks`, a new rendezvous of every rank of the
 * group, in which the ranks with joiners[r] = 1 are new processes that replace lost ones
 * (at least one joiner, at least one survivor). A joiner passes shm == NULL: it makes its
 * segment (data area zeroed, then `init(data, context)` runs on it before any peer can
 * see it; init may be NULL) and maps every rank's. A survivor passes its running `shm`
 * (same data size): it hands its segment to the joiners and maps theirs. Survivors do not
 * exchange with each other. On success *staged holds what is new: on a joiner its whole
 * shm, on a survivor the joiners' segments only, for epx__shm_adopt. On failure every
 * rank returns an error, nothing new stays mapped and `shm` is as it was. Every wait ends
 * within the ranks' timeout.
 */
epx_status_t epx__shm_rejoin(const epx__transport_ranks_t *ranks, const unsigned char *joiners,
                             size_t bytes_per_rank, epx__shm_t *shm,
                             void (*init)(void *data, void *context), void *context,
                             epx__shm_t **staged);

/* Survivor: put the joiners' segments of `staged` in place of the old ones (unmapped) and
 * free `staged`. Cannot fail. */
void epx__shm_adopt(epx__shm_t *shm, epx__shm_t *staged);

/*
 * 1 when `rank`'s process is still running as far as this process can tell (its pid is
 * visible here and has not exited), with its pid in *pid; 0 otherwise.
 */
int epx__shm_peer_running(const epx__shm_t *shm, int rank, int64_t *pid);

/* Unmap everything (the memory goes with the last mapping). NULL is a no-op. */
void epx__shm_destroy(epx__shm_t *shm);

#endif /* EPX_TRANSPORT_SHM_H */
