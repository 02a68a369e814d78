/*
 * Rejoin on the host backend (docs/STABILITY.md, "Rejoin in low-latency mode"): a new
 * process takes a lost rank's place in the survivors' running low-latency memory.
 *
 * The API layer (src/epx_ll_rejoin.c) has already made every rank agree on who joins and
 * checked that no operation is in flight. Here, over the new rendezvous:
 *   1. the ranks exchange the per-slot sequence numbers of the survivors (equal on all of
 *      them: they made the same calls), and each survivor checks that the process it
 *      lost is really gone (a live one still maps its memory and could write into it);
 *   2. each survivor sets, in its own segment, the flags that only the joiner writes to
 *      the values the joiner would have raised had it stayed ("done up to now"); a joiner
 *      sets the same in its new segment before any peer can map it. Flags live in their
 *      reader's segment, so nothing written later by anyone is overwritten;
 *   3. the segments change hands (epx__shm_rejoin: all ranks succeed or fail together);
 *   4. each survivor puts the joiner's segment in place of the dead one and unmasks it;
 *      the joiner starts from the survivors' sequence numbers.
 * Steps 1 to 3 change nothing a survivor serves with, so a failed rejoin leaves it
 * serving with the rank masked, as before.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ops/host/host.h"
#include "ops/host/host_ll.h"

/* What each rank tells the others in step 1. */
typedef struct {
    int32_t status;
    int32_t joining;
    uint64_t dispatch_seq[2];
    uint64_t combine_seq[2];
    char message[256];
} epx__rejoin_sequences_t;

/* The flags a joiner writes and its peers read, set as if it had kept up. */
typedef struct {
    const epx__host_ll_layout_t *layout;
    int world;
    const epx__rejoin_sequences_t *sequences;
} epx__rejoin_flags_t;

/*
 * In a segment's data area `data`, the flags that `peer` raises there: arrival and
 * release, both slots, at the sequence numbers the survivors reached.
 */
static void epx__rejoin_set_flags(void *data, const epx__rejoin_flags_t *f, int peer)
{
    uint64_t *flags = (uint64_t *)((char *)data + f->layout->flags);
    for (int slot = 0; slot < 2; slot++) {
        uint64_t dispatched = f->sequences->dispatch_seq[slot];
        uint64_t combined = f->sequences->combine_seq[slot];
        const uint64_t values[4] = {dispatched, dispatched, combined, combined};
        for (int kind = 0; kind < 4; kind++)
            epx__shm_flag_store(&flags[(size_t)(kind * 2 + slot) * (size_t)f->world + (size_t)peer],
                                values[kind]);
    }
}

/*
 * A joiner's new segment (epx__shm_rejoin's init): every rank's flags as of now, its own
 * included (a rank sends to itself and releases its own slot like any peer's).
 */
static void epx__rejoin_init_segment(void *data, void *context)
{
    const epx__rejoin_flags_t *f = context;
    for (int peer = 0; peer < f->world; peer++)
        epx__rejoin_set_flags(data, f, peer);
}

/* Step 1 on this rank: EPX_SUCCESS and the survivors' sequence numbers, or why not. */
static epx_status_t epx__rejoin_sequences(const epx__transport_ranks_t *ranks,
                                          const unsigned char *joiners, epx__host_ll_t *ll,
                                          epx_status_t local, epx__rejoin_sequences_t *agreed)
{
    int world = ranks->world_size, me = ranks->rank;
    epx__rejoin_sequences_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.joining = joiners[me];
    if (local == EPX_SUCCESS && !joiners[me]) {
        for (int slot = 0; slot < 2; slot++) {
            mine.dispatch_seq[slot] = ll->slots[slot].dispatch_seq;
            mine.combine_seq[slot] = ll->slots[slot].combine_seq;
        }
        for (int r = 0; r < world && local == EPX_SUCCESS; r++) {
            int64_t pid = 0;
            if (joiners[r] && epx__shm_peer_running(ll->shm, r, &pid))
                local = EPX_ERROR(EPX_ERR_INVALID_STATE,
                                  "ll_rejoin: rank %d's previous process (pid %" PRId64
                                  ") is still running on rank %d's view: end it before its "
                                  "replacement rejoins (it still maps this rank's memory)",
                                  r, pid, me);
        }
    }
    mine.status = (int32_t)local;
    if (local != EPX_SUCCESS)
        snprintf(mine.message, sizeof(mine.message), "%s", epx_last_error());
    epx__rejoin_sequences_t *all = calloc((size_t)(world > 0 ? world : 1), sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "ll_rejoin: out of memory");
    epx_status_t status = epx__bootstrap_allgather(ranks->bootstrap, &mine, all, sizeof(mine));
    if (local != EPX_SUCCESS) {
        free(all);
        return EPX_ERROR(local, "%s", mine.message);
    }
    int first_survivor = -1;
    for (int r = 0; r < world && status == EPX_SUCCESS; r++) {
        all[r].message[sizeof(all[r].message) - 1] = '\0';
        if (all[r].status != EPX_SUCCESS) {
            status = EPX_ERROR(EPX_ERR_REMOTE, "ll_rejoin: rank %d refused: %s", r,
                               all[r].message);
        } else if (!all[r].joining && first_survivor < 0) {
            first_survivor = r;
        } else if (!all[r].joining &&
                   memcmp(all[r].dispatch_seq, all[first_survivor].dispatch_seq,
                          sizeof(mine.dispatch_seq)) != 0) {
            status = EPX_ERROR(EPX_ERR_INVALID_STATE,
                               "ll_rejoin: survivors %d and %d are not in step (%" PRIu64
                               "/%" PRIu64 " and %" PRIu64 "/%" PRIu64
                               " dispatches per slot): every rank must make the same calls",
                               first_survivor, r, all[first_survivor].dispatch_seq[0],
                               all[first_survivor].dispatch_seq[1], all[r].dispatch_seq[0],
                               all[r].dispatch_seq[1]);
        } else if (!all[r].joining && memcmp(all[r].combine_seq, all[first_survivor].combine_seq,
                                             sizeof(mine.combine_seq)) != 0) {
            status = EPX_ERROR(EPX_ERR_INVALID_STATE,
                               "ll_rejoin: survivors %d and %d are not in step (they made "
                               "different numbers of combines): every rank must make the "
                               "same calls",
                               first_survivor, r);
        }
    }
    if (status == EPX_SUCCESS && first_survivor < 0)
        status = EPX_ERROR(EPX_ERR_INTERNAL, "ll_rejoin: no survivor took part");
    if (status == EPX_SUCCESS)
        *agreed = all[first_survivor];
    free(all);
    return status;
}

/* A newcomer's host buffer: low-latency state only (no normal-mode memory). */
static epx_status_t epx__rejoin_new_buffer(epx_buffer_t buffer, epx__host_buffer_t **host_out)
{
    epx__host_buffer_t *host = calloc(1, sizeof(*host));
    if (host == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create_rejoin: out of memory");
    epx_status_t status = epx__host_ll_alloc(buffer, &host->ll);
    if (status != EPX_SUCCESS) {
        free(host);
        return status;
    }
    *host_out = host;
    return EPX_SUCCESS;
}

epx_status_t epx__host_ll_rejoin(epx_buffer_t buffer, const epx__transport_ranks_t *ranks,
                                 const unsigned char *joiners)
{
    int joining = joiners[ranks->rank] != 0;
    epx__host_buffer_t *host = joining ? NULL : buffer->impl;
    epx_status_t local = joining ? epx__rejoin_new_buffer(buffer, &host) : EPX_SUCCESS;
    epx__host_ll_t *ll = host != NULL ? host->ll : NULL;
    if (local == EPX_SUCCESS && ll == NULL)
        local = EPX_ERROR(EPX_ERR_INTERNAL, "ll_rejoin: rank %d has no low-latency memory",
                          ranks->rank);

    epx__rejoin_sequences_t sequences;
    epx_status_t status = epx__rejoin_sequences(ranks, joiners, ll, local, &sequences);
    epx__rejoin_flags_t flags = {ll != NULL ? &ll->layout : NULL, ranks->world_size, &sequences};
    if (status == EPX_SUCCESS && !joining) {
        /* Before the segments change hands: nobody writes these until the rejoin ends. */
        void *own = epx__shm_peer(ll->shm, ranks->rank);
        for (int r = 0; r < ranks->world_size; r++)
            if (joiners[r])
                epx__rejoin_set_flags(own, &flags, r);
    }
    epx__shm_t *staged = NULL;
    if (status == EPX_SUCCESS)
        status = epx__shm_rejoin(ranks, joiners, ll->layout.total, joining ? NULL : ll->shm,
                                 epx__rejoin_init_segment, &flags, &staged);
    if (status != EPX_SUCCESS) {
        if (joining && host != NULL) {
            epx__host_ll_destroy(host->ll);
            free(host);
        }
        return status;
    }
    if (joining) {
        ll->shm = staged;
        for (int slot = 0; slot < 2; slot++) {
            ll->slots[slot].dispatch_seq = sequences.dispatch_seq[slot];
            ll->slots[slot].combine_seq = sequences.combine_seq[slot];
        }
        buffer->impl = host;
    } else {
        epx__shm_adopt(ll->shm, staged);
        for (int r = 0; r < ranks->world_size; r++)
            if (joiners[r])
                ll->mask[r] = 0;
    }
    EPX_DEBUG(EPX_SUBSYS_OPS, "host low-latency rejoin: rank %d %s", ranks->rank,
              joining ? "joined" : "took the newcomers in");
    return EPX_SUCCESS;
}
