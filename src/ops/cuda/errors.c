/*
 * Device-side failures as statuses, and the host's one wait (for the count exchange).
 *
 * Kernels never trap: a wait that times out, a peer's abort word, or bad input found on
 * the device ends the kernel normally after writing the error record in host-mapped
 * memory (see signal.cuh). The host reads that record at the start of every operation,
 * while it waits for counts, and when the buffer is destroyed; the first record becomes
 * the buffer's async error with a message naming the rank and the stage.
 */
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>

#include "ops/cuda/cuda_backend.h"

static const char *stage_name(int stage)
{
    switch (stage) {
    case EPX_CUDA_STAGE_LAYOUT:
        return "get_dispatch_layout";
    case EPX_CUDA_STAGE_NOTIFY:
        return "dispatch (count exchange)";
    case EPX_CUDA_STAGE_DISPATCH:
        return "dispatch (waiting for data)";
    case EPX_CUDA_STAGE_COMBINE_READY:
        return "combine (waiting for peers' inputs)";
    case EPX_CUDA_STAGE_COMBINE_DONE:
        return "combine (waiting for peers to finish reading)";
    case EPX_CUDA_STAGE_FORWARD:
        return "dispatch (waiting for tokens from another node)";
    case EPX_CUDA_STAGE_COMBINE_ENTER:
        return "combine (waiting for a home rank on another node to enter)";
    case EPX_CUDA_STAGE_COMBINE_PARTIAL:
        return "combine (waiting for partial sums from another node)";
    case EPX_CUDA_STAGE_CREDIT:
        return "dispatch (waiting for ring slots on another node to drain)";
    case EPX_CUDA_STAGE_COMBINE_CREDIT:
        return "combine (waiting for ring slots on another node to drain)";
    default:
        return "an operation";
    }
}

/* Format the record into cuda->error_*; returns its status. */
static epx_status_t describe(epx_buffer_t buffer, const volatile epx__cuda_mapped_t *m, int code)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    char *text = cuda->error_message;
    size_t size = sizeof(cuda->error_message);
    int me = buffer->group->rank, peer = m->error_peer, reporter = m->error_reporter;
    const char *stage = stage_name(m->error_stage);
    long long timeout = (long long)buffer->group->timeout_ms;
    epx_status_t status = EPX_ERR_INTERNAL;
    cuda->error_culprit = -1;

    switch (code) {
    case EPX_CUDA_FAIL_TIMEOUT:
        status = EPX_ERR_TIMEOUT;
        cuda->error_culprit = peer;
        snprintf(text, size, "%s: rank %d did not answer within %lld ms (seen by rank %d)", stage,
                 peer, timeout, me);
        break;
    case EPX_CUDA_FAIL_ABORT:
        /* error_value holds the abort code: 1 = the culprit timed out, 2 = it failed. */
        cuda->error_culprit = peer;
        if (m->error_value == 1) {
            status = EPX_ERR_TIMEOUT;
            snprintf(text, size,
                     "%s: rank %d did not answer within %lld ms (reported by rank %d)", stage,
                     peer, timeout, reporter);
        } else {
            status = EPX_ERR_REMOTE;
            snprintf(text, size, "%s: rank %d failed (reported by rank %d)", stage, peer,
                     reporter);
        }
        break;
    case EPX_CUDA_FAIL_EXPERT_ID: {
        int k = buffer->config.num_topk;
        status = EPX_ERR_INVALID_ARG;
        snprintf(text, size,
                 "%s: topk_idx[%" PRId64 "][%" PRId64 "] is %" PRId64
                 ", expected -1 (none) or an expert id in 0..%d",
                 m->error_stage == EPX_CUDA_STAGE_LAYOUT ? "get_dispatch_layout" : "dispatch",
                 m->error_index / k, m->error_index % k, m->error_value,
                 buffer->config.num_experts - 1);
        break;
    }
    case EPX_CUDA_FAIL_PEER_INPUT:
        status = EPX_ERR_REMOTE;
        cuda->error_culprit = peer;
        snprintf(text, size, "%s: rank %d passed invalid topk_idx (an expert id out of range)",
                 stage, peer);
        break;
    case EPX_CUDA_FAIL_ROWS:
        status = EPX_ERR_INVALID_ARG;
        snprintf(text, size,
                 "combine: rank %d's x has %" PRId64 " rows, but rank %d's token was received "
                 "at its row %" PRId64,
                 peer, m->error_index, me, m->error_value);
        break;
    default:
        snprintf(text, size, "%s: the device recorded an unknown failure code %d", stage, code);
        break;
    }
    return status;
}

int epx__cuda_note_failure(epx_buffer_t buffer)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    const volatile epx__cuda_mapped_t *m = cuda->mapped;
    /* A buffer being torn down may have no record left (low-latency failures have
     * their own: epx__cuda_ll_poll). */
    if (m == NULL)
        return 0;
    if (!cuda->error_seen) {
        int code = m->error_code;
        if (code == EPX_CUDA_FAIL_NONE)
            return 0;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        cuda->error_status = describe(buffer, m, code);
        cuda->error_seen = 1;
        EPX_WARN(EPX_SUBSYS_OPS, "device: %s", cuda->error_message);
        epx__buffer_set_async_error(buffer, cuda->error_status, cuda->error_message);
        /* Peers waiting in a combine's exchange of inputs mapped on demand stop too
         * (the first failure published there wins). */
        if (cuda->autoreg.shm != NULL)
            epx__shm_abort(cuda->autoreg.shm, cuda->error_status, cuda->error_message);
        /* The kernel told this node's ranks (their abort words); the ranks of other nodes
         * get the word by a put now (when this host sees the record: its next epx call or
         * wait). A failure passed on from a peer is not passed on again, and a bad id
         * found by get_dispatch_layout is this rank's alone (its kernel told nobody). */
        int own = code != EPX_CUDA_FAIL_ABORT && code != EPX_CUDA_FAIL_PEER_INPUT &&
                  m->error_stage != EPX_CUDA_STAGE_LAYOUT;
        if (own) {
            int timeout = code == EPX_CUDA_FAIL_TIMEOUT;
            int me = buffer->group->rank, culprit = timeout ? m->error_peer : me;
            *cuda->abort_word = EPX_CUDA_ABORT_PACK(timeout ? 1 : 2, m->error_stage, me, culprit);
            epx__cuda_xn_tell(cuda, timeout ? culprit : -1, cuda->abort_stream);
        }
    }
    return 1;
}

epx_status_t epx__cuda_poll(epx_buffer_t buffer)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    if (!epx__cuda_note_failure(buffer))
        return EPX_SUCCESS;
    return EPX_ERROR(cuda->error_status, "%s", cuda->error_message);
}

int epx__cuda_failure_culprit(epx_buffer_t buffer)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    return epx__cuda_note_failure(buffer) ? cuda->error_culprit : -1;
}

epx_status_t epx__cuda_wait_ticket(epx_buffer_t buffer, uint64_t ticket, const char *op)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    const volatile epx__cuda_mapped_t *m = cuda->mapped;
    /* The device's own waits time out first and say more; this one only catches a
     * kernel that never ran. */
    int64_t limit_ns = buffer->group->timeout_ms * 1000000 + 5000000000ll;
    int64_t start = epx__now_ns();
    for (uint32_t spin = 0; m->ticket != ticket; spin++) {
        if (m->error_code != EPX_CUDA_FAIL_NONE)
            return epx__cuda_poll(buffer);
        if ((spin & 1023) == 1023) {
            if (epx__now_ns() - start > limit_ns)
                return EPX_ERROR(EPX_ERR_TIMEOUT,
                                 "%s: rank %d's count exchange did not finish within %lld ms "
                                 "(its kernel never ran?)",
                                 op, buffer->group->rank,
                                 (long long)(limit_ns / 1000000));
            sched_yield();
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return EPX_SUCCESS;
}
