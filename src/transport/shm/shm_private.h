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
} epx__shm_header_t;

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
    /* A failure learned from a peer in a barrier: published under the peer's rank if
     * this rank aborts because of it, so every rank names the first failure. */
    int learned_rank;
    epx_status_t learned_status;
    int64_t learned_exited_pid;
    char learned_message[EPX__SHM_MESSAGE_BYTES];
};

/* 1 if the process has exited (gone, or a zombie not yet reaped); 0 if alive. */
int epx__shm_pid_exited(int64_t pid);

#endif /* EPX_TRANSPORT_SHM_PRIVATE_H */
