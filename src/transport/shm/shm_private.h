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
    epx__shm_header_t **headers; /* [world_size] mapped segments, own included */
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
 * On failure every received descriptor is closed again.
 */
int epx__shm_anonymous_file(void);
epx_status_t epx__shm_listen(struct epx__shm *shm, char *name, size_t name_size, int *listen_fd);
epx_status_t epx__shm_exchange_fds(struct epx__shm *shm, int listen_fd, int own_fd,
                                   const char *const *names, int *fds);

#endif /* EPX_TRANSPORT_SHM_PRIVATE_H */
