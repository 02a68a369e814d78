/*
 * Waiting on peers through shared memory: the counting barrier, the abort word, and
 * the liveness checks that turn a dead or failed peer into an error instead of a hang.
 *
 * Barrier: each rank owns a counter in its header and bumps it (release) on arrival;
 * it may leave once every peer's counter (acquire) has reached its own value. Every
 * rank runs the same sequence of barriers, so counters never need a reset and a fast
 * rank can run ahead into the next barrier without confusing a slow one.
 *
 * The wait spins briefly (a barrier between busy ranks completes in microseconds),
 * then yields (ranks may outnumber cores), then sleeps 50 us at a time. Every 10 ms it
 * looks for trouble: a peer's published failure, a peer process that is gone, or the
 * group's timeout.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "transport/shm/shm_private.h"

#define EPX__SHM_SPIN_ROUNDS 200
#define EPX__SHM_YIELD_NS 2000000ll /* yield for the first 2 ms, then sleep */
#define EPX__SHM_SLEEP_NS 50000l
#define EPX__SHM_CHECK_NS 10000000ll /* look for failed peers every 10 ms */

static inline void epx__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

int epx__shm_pid_exited(int64_t pid)
{
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH)
        return 1;
    /* A child that exited but was not reaped yet is a zombie and still answers kill();
     * its state letter in /proc/<pid>/stat (after the parenthesised name) tells. */
    char path[64];
    snprintf(path, sizeof(path), "/proc/%" PRId64 "/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT;
    char text[512];
    ssize_t length = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (length <= 0)
        return 0;
    text[length] = '\0';
    const char *name_end = strrchr(text, ')');
    if (name_end == NULL || name_end[1] != ' ')
        return 0;
    return name_end[2] == 'Z' || name_end[2] == 'X';
}

/* Remember a peer's failure so that this rank's own abort republishes it. */
static void epx__shm_learn(struct epx__shm *shm, int rank, epx_status_t status, int64_t exited_pid,
                           const char *message)
{
    if (shm->learned_rank >= 0)
        return;
    shm->learned_rank = rank;
    shm->learned_status = status;
    shm->learned_exited_pid = exited_pid;
    snprintf(shm->learned_message, sizeof(shm->learned_message), "%s", message);
}

/* The error for a rank whose process is gone, seen directly or through a peer. */
static epx_status_t epx__shm_exited_error(const char *stage, int rank, int64_t pid)
{
    return EPX_ERROR(EPX_ERR_REMOTE, "%s: rank %d (pid %" PRId64 ") exited", stage, rank, pid);
}

/* EPX_SUCCESS, or the error for a peer that published a failure. */
static epx_status_t epx__shm_check_abort(struct epx__shm *shm, int peer, const char *stage)
{
    epx__shm_header_t *header = shm->headers[peer];
    if (atomic_load_explicit(&header->abort_state, memory_order_acquire) != EPX__ABORT_PUBLISHED)
        return EPX_SUCCESS;
    char message[EPX__SHM_MESSAGE_BYTES];
    memcpy(message, header->abort_message, sizeof(message));
    message[sizeof(message) - 1] = '\0';
    int origin = header->abort_rank;
    int64_t exited_pid = header->abort_exited_pid;
    epx_status_t remote = (epx_status_t)header->abort_status;
    /* A peer that timed out is itself waiting on someone: the error class stays a
     * timeout, so the caller can tell "too slow" from "broken". */
    epx_status_t status = remote == EPX_ERR_TIMEOUT ? EPX_ERR_TIMEOUT : EPX_ERR_REMOTE;
    epx__shm_learn(shm, origin, status, exited_pid, message);
    if (exited_pid != 0)
        return epx__shm_exited_error(stage, origin, exited_pid);
    if (remote == EPX_ERR_TIMEOUT)
        return EPX_ERROR(status, "%s: rank %d timed out: %s", stage, origin, message);
    return EPX_ERROR(status, "%s: rank %d failed: %s", stage, origin, message);
}

/* EPX_SUCCESS, or the error for a peer that refused the call this barrier belongs to. */
static epx_status_t epx__shm_check_refusal(struct epx__shm *shm, int peer, const char *stage,
                                           uint64_t target)
{
    epx__shm_header_t *header = shm->headers[peer];
    uint64_t word = atomic_load_explicit(&header->refusal, memory_order_acquire);
    if (word == 0 || EPX__SHM_REFUSAL_TARGET(word) != target)
        return EPX_SUCCESS;
    uint32_t mine = shm->refusal_target == target ? shm->refusal_count : 0;
    if (EPX__SHM_REFUSAL_COUNT(word) <= mine)
        return EPX_SUCCESS; /* a call this rank refused too: nobody waited for it */
    char message[EPX__SHM_MESSAGE_BYTES];
    memcpy(message, header->refusal_message, sizeof(message));
    message[sizeof(message) - 1] = '\0';
    return EPX_ERROR(EPX_ERR_REMOTE, "%s: rank %d refused the call: %s", stage, peer, message);
}

void epx__shm_refuse(epx__shm_t *shm, const char *message)
{
    if (shm == NULL)
        return;
    uint64_t target = shm->arrivals + 1;
    if (shm->refusal_target != target) {
        shm->refusal_target = target;
        shm->refusal_count = 0;
    }
    if (shm->refusal_count < 0xffffu)
        shm->refusal_count++;
    epx__shm_header_t *header = shm->headers[shm->rank];
    /* A peer reads the message only after it sees a new word (release / acquire); one
     * overwritten while a peer copies it can only come from a later refusal that the
     * peer would report as well. */
    snprintf(header->refusal_message, sizeof(header->refusal_message), "%s",
             message != NULL ? message : "");
    atomic_store_explicit(&header->refusal, EPX__SHM_REFUSAL(target, shm->refusal_count),
                          memory_order_release);
}

epx_status_t epx__shm_check_failed(epx__shm_t *shm, const char *stage)
{
    for (int r = 0; r < shm->world_size; r++)
        if (r != shm->rank)
            EPX_CHECK(epx__shm_check_abort(shm, r, stage));
    return EPX_SUCCESS;
}

/* Look for a failed or dead peer that has not arrived, and for the deadline. */
static epx_status_t epx__shm_check_peers(struct epx__shm *shm, const char *stage, uint64_t target,
                                         int64_t waited_ns)
{
    EPX_CHECK(epx__shm_check_failed(shm, stage));
    for (int r = 0; r < shm->world_size; r++)
        if (r != shm->rank &&
            atomic_load_explicit(&shm->headers[r]->arrivals, memory_order_acquire) < target)
            EPX_CHECK(epx__shm_check_refusal(shm, r, stage, target));

    for (int r = 0; r < shm->world_size; r++) {
        if (r == shm->rank || !shm->pid_visible[r])
            continue;
        if (atomic_load_explicit(&shm->headers[r]->arrivals, memory_order_acquire) >= target)
            continue;
        if (!epx__shm_pid_exited(shm->pids[r]))
            continue;
        /* It may have published why just before it went. */
        EPX_CHECK(epx__shm_check_abort(shm, r, stage));
        char message[EPX__SHM_MESSAGE_BYTES];
        snprintf(message, sizeof(message), "exited during %s", stage);
        epx__shm_learn(shm, r, EPX_ERR_REMOTE, shm->pids[r], message);
        return epx__shm_exited_error(stage, r, shm->pids[r]);
    }

    if (waited_ns < shm->timeout_ms * 1000000ll)
        return EPX_SUCCESS;
    char missing[256];
    size_t used = 0;
    int count = 0;
    missing[0] = '\0';
    for (int r = 0; r < shm->world_size && used < sizeof(missing); r++) {
        if (atomic_load_explicit(&shm->headers[r]->arrivals, memory_order_acquire) >= target)
            continue;
        int n = snprintf(missing + used, sizeof(missing) - used, "%s%d", used ? ", " : "", r);
        if (n < 0)
            break;
        used += (size_t)n;
        count++;
    }
    /* "rank 3" or "ranks 3, 5": the words a reader (or a test) looks for. */
    return EPX_ERROR(EPX_ERR_TIMEOUT, "%s: rank%s %s did not arrive within %" PRId64 " ms", stage,
                     count > 1 ? "s" : "", missing, shm->timeout_ms);
}

/* The first rank at or after `from` whose counter is below `target`, or world_size. */
static int epx__shm_first_behind(const struct epx__shm *shm, int from, uint64_t target)
{
    for (int r = from; r < shm->world_size; r++)
        if (atomic_load_explicit(&shm->headers[r]->arrivals, memory_order_acquire) < target)
            return r;
    return shm->world_size;
}

epx_status_t epx__shm_barrier(epx__shm_t *shm, const char *stage)
{
    uint64_t target = ++shm->arrivals;
    /* Release: everything this rank wrote (into any segment) before arriving is visible
     * to a peer that sees the new count. */
    atomic_store_explicit(&shm->headers[shm->rank]->arrivals, target, memory_order_release);

    int behind = epx__shm_first_behind(shm, 0, target);
    if (behind == shm->world_size)
        return EPX_SUCCESS;
    int64_t start = epx__now_ns();
    int64_t next_check = start + EPX__SHM_CHECK_NS;
    for (long round = 0;; round++) {
        behind = epx__shm_first_behind(shm, behind, target);
        if (behind == shm->world_size)
            return EPX_SUCCESS;
        if (round < EPX__SHM_SPIN_ROUNDS) {
            epx__cpu_relax();
            continue;
        }
        int64_t now = epx__now_ns();
        if (now - start < EPX__SHM_YIELD_NS) {
            sched_yield();
        } else {
            struct timespec pause = {0, EPX__SHM_SLEEP_NS};
            nanosleep(&pause, NULL);
        }
        if (now >= next_check) {
            EPX_CHECK(epx__shm_check_peers(shm, stage, target, now - start));
            next_check = now + EPX__SHM_CHECK_NS;
        }
    }
}

void epx__shm_abort(epx__shm_t *shm, epx_status_t status, const char *message)
{
    if (shm == NULL)
        return;
    epx__shm_header_t *header = shm->headers[shm->rank];
    int32_t expected = EPX__ABORT_NONE;
    if (!atomic_compare_exchange_strong_explicit(&header->abort_state, &expected,
                                                 EPX__ABORT_WRITING, memory_order_acq_rel,
                                                 memory_order_acquire))
        return; /* an earlier failure is already published */
    if ((status == EPX_ERR_REMOTE || status == EPX_ERR_TIMEOUT) && shm->learned_rank >= 0) {
        header->abort_status = shm->learned_status;
        header->abort_rank = shm->learned_rank;
        header->abort_exited_pid = shm->learned_exited_pid;
        message = shm->learned_message;
    } else {
        header->abort_status = status;
        header->abort_rank = shm->rank;
        header->abort_exited_pid = 0;
    }
    snprintf(header->abort_message, sizeof(header->abort_message), "%s",
             message != NULL ? message : epx_status_string(status));
    atomic_store_explicit(&header->abort_state, EPX__ABORT_PUBLISHED, memory_order_release);
}
