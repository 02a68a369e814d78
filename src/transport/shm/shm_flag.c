/*
 * Point-to-point waits on sequence flags in shared memory, for the low-latency mode:
 * unlike the barrier, a rank waits only for the peers it exchanges with, and a peer
 * that fails does not stop the wait for the others (the caller leaves it out).
 *
 * A flag is a uint64 that its writer raises (release) to a sequence number after the
 * data it guards; the reader waits (acquire) until it reaches the target. Pacing
 * follows the barrier in shm_wait.c: spin, then yield, then sleep, looking every 10 ms
 * for a peer that published a failure or whose process is gone, until the timeout.
 */
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "transport/shm/shm_private.h"

#define EPX__FLAG_SPIN_ROUNDS 200
#define EPX__FLAG_YIELD_NS 2000000ll
#define EPX__FLAG_SLEEP_NS 50000l
#define EPX__FLAG_CHECK_NS 10000000ll

uint64_t epx__shm_flag_load(const uint64_t *flag)
{
    return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
}

void epx__shm_flag_store(uint64_t *flag, uint64_t value)
{
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}

/* Why peer `r` will not raise its flag, or EPX_SUCCESS while it may still. */
static epx_status_t epx__flag_peer_state(struct epx__shm *shm, int r, char *why, size_t size)
{
    epx__shm_header_t *header = shm->headers[r];
    if (atomic_load_explicit(&header->abort_state, memory_order_acquire) == EPX__ABORT_PUBLISHED) {
        char message[EPX__SHM_MESSAGE_BYTES];
        memcpy(message, header->abort_message, sizeof(message));
        message[sizeof(message) - 1] = '\0';
        snprintf(why, size, "rank %d failed: %s", r, message);
        return header->abort_status == EPX_ERR_TIMEOUT ? EPX_ERR_TIMEOUT : EPX_ERR_REMOTE;
    }
    if (shm->pid_visible[r] && epx__shm_pid_exited(shm->pids[r])) {
        snprintf(why, size, "rank %d (pid %" PRId64 ") exited", r, shm->pids[r]);
        return EPX_ERR_REMOTE;
    }
    return EPX_SUCCESS;
}

/*
 * arrived_ns[r] = now for each flag that reached the target since the last look (those
 * still at -1, failed ones left out); the clock is read once, and only when one arrived.
 */
static void epx__flag_note_arrivals(uint64_t *const *flags, const uint8_t *failed, int world,
                                    uint64_t target, int64_t *arrived_ns)
{
    int64_t now = -1;
    for (int r = 0; r < world; r++) {
        if (flags[r] == NULL || failed[r] || arrived_ns[r] >= 0 ||
            epx__shm_flag_load(flags[r]) < target)
            continue;
        if (now < 0)
            now = epx__now_ns();
        arrived_ns[r] = now;
    }
}

epx_status_t epx__shm_wait_flags(epx__shm_t *shm, const char *stage, uint64_t *const *flags,
                                 uint64_t target, uint8_t *failed, int64_t *arrived_ns)
{
    int world = shm->world_size;
    int pending = 0;
    for (int r = 0; r < world; r++)
        if (flags[r] != NULL && epx__shm_flag_load(flags[r]) < target)
            pending++;
    /* Arrivals are noted after the count: a flag the count saw arrive is noted too
     * (flags only grow), so a wait that ends has a time for every flag it waited for. */
    if (arrived_ns != NULL) {
        for (int r = 0; r < world; r++)
            arrived_ns[r] = -1;
        epx__flag_note_arrivals(flags, failed, world, target, arrived_ns);
    }
    if (pending == 0)
        return EPX_SUCCESS;
    epx_status_t first = EPX_SUCCESS;
    char first_why[400] = "";
    int64_t start = epx__now_ns();
    int64_t next_check = start + EPX__FLAG_CHECK_NS;
    for (long round = 0;; round++) {
        pending = 0;
        for (int r = 0; r < world; r++)
            if (flags[r] != NULL && !failed[r] && epx__shm_flag_load(flags[r]) < target)
                pending++;
        if (arrived_ns != NULL)
            epx__flag_note_arrivals(flags, failed, world, target, arrived_ns);
        if (pending == 0)
            break;
        if (round < EPX__FLAG_SPIN_ROUNDS) {
            continue;
        }
        int64_t now = epx__now_ns();
        if (now - start < EPX__FLAG_YIELD_NS) {
            sched_yield();
        } else {
            struct timespec pause = {0, EPX__FLAG_SLEEP_NS};
            nanosleep(&pause, NULL);
        }
        if (now < next_check)
            continue;
        next_check = now + EPX__FLAG_CHECK_NS;
        int timed_out = now - start >= shm->timeout_ms * 1000000ll;
        for (int r = 0; r < world; r++) {
            if (flags[r] == NULL || failed[r] || epx__shm_flag_load(flags[r]) >= target)
                continue;
            char why[400];
            epx_status_t status = epx__flag_peer_state(shm, r, why, sizeof(why));
            if (status == EPX_SUCCESS && timed_out) {
                status = EPX_ERR_TIMEOUT;
                snprintf(why, sizeof(why), "rank %d did not answer within %" PRId64 " ms", r,
                         shm->timeout_ms);
            }
            if (status == EPX_SUCCESS)
                continue;
            failed[r] = 1;
            if (first == EPX_SUCCESS) {
                first = status;
                snprintf(first_why, sizeof(first_why), "%s", why);
            }
        }
    }
    if (first == EPX_SUCCESS)
        return EPX_SUCCESS;
    return EPX_ERROR(first, "%s: %s", stage, first_why);
}
