/*
 * Shared between shm.c (segments) and shm_wait.c (barrier, abort, liveness) only.
 */
#ifndef EPX_TRANSPORT_SHM_PRIVATE_H
#define EPX_TRANSPORT_SHM_PRIVATE_H

#include <stdatomic.h>
#include <stdint.h>

#include "transport/shm/shm.h"

#define EPX__SHM_MAGIC 0x316d68732d787065ull /* "epx-shm1" little endian */
#define EPX__SHM_HEADER_BYTES 4096u
#define EPX__SHM_MESSAGE_BYTES 320
#define EPX__SHM_NAME_BYTES 64

/* Abort word states: the message is complete only once the state is PUBLISHED. */
enum { EPX__ABORT_NONE = 0, EPX__ABORT_WRITING = 1, EPX__ABORT_PUBLISHED = 2 };

/*
 * The control header at the start of each segment. Fields written by different parties
 * or at different rates sit on their own cache lines: the arrival counter is hammered
 * by waiting peers, the abort word is written once. Only the owner writes its header.
 */
typedef struct {
    uint64_t magic;
    int64_t pid;
    uint64_t data_bytes;
    int32_t rank;
    int32_t world_size;

    _Alignas(64) _Atomic uint64_t arrivals;

    _Alignas(64) _Atomic int32_t abort_state;
    int32_t abort_status;
    int32_t abort_rank;       /* the rank that failed first (may be a peer of the owner) */
    int64_t abort_exited_pid; /* nonzero: abort_rank did not fail, its process exited */
    char abort_message[EPX__SHM_MESSAGE_BYTES];

    /* The owner refused a call before its first barrier (epx__shm_refuse): the barrier
     * target it did not reach in the high 48 bits, how many calls it refused in a row at
     * that target in the low 16; 0 = none. The message is written before the word. */
    _Alignas(64) _Atomic uint64_t refusal;
    char refusal_message[EPX__SHM_MESSAGE_BYTES];
} epx__shm_header_t;

#define EPX__SHM_REFUSAL(target, count) (((uint64_t)(target) << 16) | ((uint64_t)(count) & 0xffffu))
#define EPX__SHM_REFUSAL_TARGET(word) ((word) >> 16)
#define EPX__SHM_REFUSAL_COUNT(word) ((uint32_t)((word) & 0xffffu))

_Static_assert(sizeof(epx__shm_header_t) <= EPX__SHM_HEADER_BYTES,
               "the shm control header must fit in front of the data area");

struct epx__shm {
    int rank;
    int world_size;
    int64_t timeout_ms;
    size_t data_bytes;
    size_t segment_bytes;
    /* This rank's segment descriptor, kept open so that a rank that rejoins can be given
     * it (shm_rejoin.c); -1 in a survivor's staging of a rejoin. */
    int own_fd;
    epx__shm_header_t **headers; /* [world_size] mapped segments, own included; NULL = not
                                  * mapped (the other survivors in a rejoin's staging) */
    int64_t *pids;               /* [world_size] */
    /* [world_size] 1 when the peer's pid is visible here (same pid namespace), so that
     * its death can be detected; 0 leaves that peer to the timeout. */
    unsigned char *pid_visible;
    uint64_t arrivals; /* this rank's counter (only this rank writes it) */
    /* Calls this rank refused in a row while its counter stood at refusal_target - 1. */
    uint64_t refusal_target;
    uint32_t refusal_count;
    /* A failure learned from a peer in a barrier: published under the peer's rank if
     * this rank aborts because of it, so every rank names the first failure. */
    int learned_rank;
    epx_status_t learned_status;
    int64_t learned_exited_pid;
    char learned_message[EPX__SHM_MESSAGE_BYTES];
};

/* What each rank tells the others in the setup allgathers (shm.c, shm_rejoin.c). */
typedef struct {
    char name[EPX__SHM_NAME_BYTES]; /* the abstract socket that hands out the segment */
    uint64_t data_bytes;
    int64_t pid;
    int32_t status; /* epx_status_t of this rank's step */
    int32_t pad;
    char message[EPX__SHM_MESSAGE_BYTES];
} epx__shm_record_t;

/*
 * Set-up steps shared by epx__shm_create and epx__shm_rejoin (shm.c):
 * epx__shm_alloc: the bookkeeping of a group's segments, nothing mapped (NULL on out of
 * memory). epx__shm_create_own: make, size and map this rank's segment (its descriptor in
 * shm->own_fd). epx__shm_map_peer: map the segment `fd` that rank `peer` sent, after
 * checking its header names that rank and shm->pids[peer]. epx__shm_record_fail: note
 * this rank's failed step in its record (the first one wins). epx__shm_first_failure: the
 * rank whose failure this rank reports (its own first, else the lowest), -1 if none;
 * epx__shm_setup_error: that failure as this rank's error. epx__shm_probe_pids: take every
 * rank's pid from the records and note which ones this process can see.
 */
struct epx__shm *epx__shm_alloc(const epx__transport_ranks_t *ranks, size_t bytes_per_rank);
epx_status_t epx__shm_create_own(struct epx__shm *shm);
epx_status_t epx__shm_map_peer(struct epx__shm *shm, int peer, int fd);
void epx__shm_record_fail(epx__shm_record_t *record, epx_status_t status, const char *message);
int epx__shm_first_failure(const epx__shm_record_t *records, int world_size, int rank);
epx_status_t epx__shm_setup_error(const struct epx__shm *shm, const epx__shm_record_t *records,
                                  int failed);
void epx__shm_probe_pids(struct epx__shm *shm, const epx__shm_record_t *records);

/*
 * The second half of set-up, shared by epx__shm_create and epx__shm_rejoin (shm.c):
 * trade descriptors with the ranks in `peers` (NULL = every other rank; see
 * epx__shm_exchange_fds), close `listen_fd`, map each peer's segment, close the received
 * descriptors, then learn over `bootstrap` (into `records`, one per rank) whether every
 * rank mapped what it needed: all succeed or fail together.
 */
epx_status_t epx__shm_map_peers(struct epx__shm *shm, epx__bootstrap_t *bootstrap, int listen_fd,
                                int own_fd, const char *const *names, const unsigned char *peers,
                                int *fds, epx__shm_record_t *records);

/* 1 if the process has exited (gone, or a zombie not yet reaped); 0 if alive. */
int epx__shm_pid_exited(int64_t pid);

/* A random 64-bit value for names (shm.c). */
uint64_t epx__shm_random(void);

/*
 * Segment descriptors without names (shm_fd.c). epx__shm_anonymous_file: a new empty
 * file that no name reaches (-1 with errno on failure). epx__shm_listen: a listening
 * Unix socket in the abstract namespace, its name (without the leading NUL) in `name`.
 * epx__shm_exchange_fds: with every rank's socket name known (names[r]) and shm->pids
 * set, give `own_fd` to every peer and receive theirs into fds[r] (fds[rank] = -1).
 * `peers` (NULL = every rank) limits the exchange to the ranks r with peers[r] = 1, in
 * both directions; it must be symmetric (r is this rank's peer iff this rank is r's).
 * On failure every received descriptor is closed again.
 */
int epx__shm_anonymous_file(void);
epx_status_t epx__shm_listen(struct epx__shm *shm, char *name, size_t name_size, int *listen_fd);
epx_status_t epx__shm_exchange_fds(struct epx__shm *shm, int listen_fd, int own_fd,
                                   const char *const *names, const unsigned char *peers,
                                   int *fds);

#endif /* EPX_TRANSPORT_SHM_PRIVATE_H */
