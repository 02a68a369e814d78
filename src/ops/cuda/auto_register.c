/*
 * Combine inputs mapped on demand (config.auto_register; docs/DESIGN.md section 7). A
 * combine whose x lies outside the buffer and outside the ranges of epx_buffer_register
 * would copy x into the buffer first: a second pass over every received row. With
 * auto_register on, the allocation holding x is mapped by every peer the first time it
 * is seen (as epx_buffer_register would, over CUDA IPC) and read in place from then on.
 * An engine's expert outputs come from a caching allocator that hands back the same
 * allocations step after step, so after the first steps every combine hits.
 *
 * Every combine, every rank: one exchange of a 16-byte record through host shared memory
 * (transport/shm: a barrier that ends early when a peer published a failure, exited or
 * timed out), so that all ranks take the same collective steps:
 *   - each rank looks its x's allocation up among its slots (start, size and the
 *     driver's allocation id, which a new allocation at an old address does not share);
 *   - if some rank's allocation is new, every rank maps every new allocation in one
 *     slot: a free slot, else the one read longest ago (its mappings closed after this
 *     rank's device is idle), never one read by this combine; first, the slots holding
 *     allocations their rank has freed are evicted (CUDA refuses to open a new
 *     allocation over an address range a peer still holds open);
 *   - a rank whose x is mapped publishes its region and offset, as for a registered
 *     range; the others copy x in as before.
 * No mapping happens in a combine where some rank is capturing a CUDA graph (a graph
 * keeps the region it was captured with, and slots are evicted; a capturing rank neither
 * maps nor reads a slot). Memory without a CUDA IPC handle (cudaMallocAsync, VMM such as
 * PyTorch's expandable segments) is copied in, said once. A mapping step that fails
 * turns the feature off on every rank, with a warning; a peer's failure or timeout fails
 * the combine.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/cuda_backend.h"
#include "ops/group.h"

#define AUTO_SLOT_MASK ((1u << EPX_CUDA_AUTO_SLOTS) - 1)

static int slot_holds(const epx__cuda_auto_slot_t *slot, const epx__cuda_ipc_allocation_t *a)
{
    return slot->mine.bytes != 0 && slot->mine.base == a->base && slot->mine.bytes == a->bytes &&
           slot->mine.id == a->id;
}

/* Slots whose allocation of this rank is gone (freed; maybe another one at its address). */
static uint32_t stale_slots(const epx__cuda_auto_t *au)
{
    uint32_t stale = 0;
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        const epx__cuda_ipc_allocation_t *m = &au->slots[i].mine;
        epx__cuda_ipc_allocation_t now;
        if (m->bytes == 0)
            continue;
        if (!epx__cuda_ipc_find_allocation((void *)m->base, &now) ||
            !slot_holds(&au->slots[i], &now))
            stale |= 1u << i;
    }
    return stale;
}

/* A free slot, else the one read longest ago and not in `used`; -1 when none. */
static int pick_slot(const epx__cuda_auto_t *au, uint32_t used)
{
    int victim = -1;
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        if (!au->slots[i].occupied)
            return i;
        if ((used & (1u << i)) == 0 &&
            (victim < 0 || au->slots[i].last_use < au->slots[victim].last_use))
            victim = i;
    }
    return victim;
}

void epx__cuda_auto_plan(const epx__cuda_auto_t *au, const epx__cuda_auto_record_t *all,
                         int world, epx__cuda_auto_plan_t *plan)
{
    memset(plan, 0, sizeof(*plan));
    plan->victim = -1;
    for (int r = 0; r < world; r++) {
        plan->stale |= all[r].stale & AUTO_SLOT_MASK;
        plan->capturing |= all[r].capturing != 0;
    }
    for (int r = 0; r < world; r++) {
        int used = all[r].used;
        int in_slot = used >= 0 && used < EPX_CUDA_AUTO_SLOTS;
        /* A rank whose x sits in a slot evicted now maps it again. */
        if (in_slot && (plan->stale & (1u << used)) == 0)
            plan->used |= 1u << used;
        plan->wanted |= all[r].want || (in_slot && (plan->stale & (1u << used)) != 0);
    }
    plan->map = !plan->capturing && (plan->wanted || plan->stale != 0);
    if (!plan->map || !plan->wanted)
        return;
    /* A stale slot is evicted first and so free: the lowest one is taken before any
     * other; else a free slot, else the one read longest ago and not in this call. */
    for (int i = EPX_CUDA_AUTO_SLOTS - 1; i >= 0; i--)
        if ((plan->stale & (1u << i)) != 0)
            plan->victim = i;
    if (plan->victim < 0)
        plan->victim = pick_slot(au, plan->used);
}

/* Close slot `i`'s mappings here (local; the device drained first by the caller: this
 * rank's queued kernels may read them). The peers' allocations stay theirs. */
static epx_status_t evict(epx__cuda_buffer_t *cuda, int i)
{
    epx__cuda_auto_slot_t *slot = &cuda->autoreg.slots[i];
    epx_status_t status = EPX_SUCCESS;
    if (slot->occupied)
        status = epx__cuda_write_range_row(cuda, EPX_CUDA_MAX_REGISTERED + i, NULL);
    epx__cuda_ipc_range_unmap(&cuda->ipc_cache, slot->range);
    memset(slot, 0, sizeof(*slot));
    return status;
}

static epx_status_t drain(void)
{
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "combine: waiting for queued work before closing "
                                            "inputs mapped on demand");
    return EPX_SUCCESS;
}

/* Feature off on this rank (every rank does the same, from the same failed vote): every
 * slot closed, so nothing stale is left open for epx_buffer_register to trip over. */
static void turn_off(epx__cuda_buffer_t *cuda, const char *why)
{
    EPX_WARN(EPX_SUBSYS_OPS,
             "combine: mapping inputs on demand failed (%s); auto_register is off for this "
             "buffer from now on and combines copy x into the buffer",
             why);
    epx__clear_error();
    cuda->autoreg.on = 0;
    /* Undrained, the mappings stay open until the buffer is destroyed. */
    if (cudaDeviceSynchronize() != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++)
        (void)evict(cuda, i);
    epx__clear_error();
}

/* A failure every rank sees alike may turn the feature off; a peer gone (timeout, the
 * bootstrap) fails the combine. */
static int fatal(epx_status_t status)
{
    return status == EPX_ERR_TIMEOUT || status == EPX_ERR_BOOTSTRAP;
}

/*
 * The mapping step of one combine (collective; entered by every rank alike): evict the
 * stale slots, then, with `victim` >= 0, map every rank's new allocation there (`offer`:
 * this rank's, bytes 0 for none). Local failures travel in the votes, so every rank
 * returns the same kind of answer.
 */
static epx_status_t map_round(epx_buffer_t buffer, uint32_t stale, int victim,
                              const epx__cuda_ipc_allocation_t *offer, cudaStream_t stream,
                              uint64_t now)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx_group_t group = buffer->group;
    epx__cuda_auto_t *au = &cuda->autoreg;
    int evicting = stale != 0 || (victim >= 0 && au->slots[victim].occupied);
    epx_status_t local = evicting ? drain() : EPX_SUCCESS;
    /* Undrained, queued kernels may still read the mappings: they stay open (the vote
     * below fails every rank's step alike). */
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS && local == EPX_SUCCESS; i++)
        if ((stale & (1u << i)) != 0 || i == victim)
            local = evict(cuda, i);
    if (victim < 0)
        return epx__cuda_vote(group, local, "combine", "could not close inputs mapped on demand");

    int reach[EPX_CUDA_MAX_RANKS];
    for (int r = 0; r < group->world_size; r++)
        reach[r] = r != group->rank && cuda->peer_bases[r] != NULL;
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    epx__cuda_ipc_range_t *range = NULL;
    epx_status_t status = epx__cuda_ipc_range_map(&ranks, &cuda->ipc_cache, (void *)offer->base,
                                                  offer->bytes, reach, local,
                                                  "combine (mapping x on demand)", &range);
    if (status != EPX_SUCCESS)
        return status;
    char *table[EPX_CUDA_MAX_RANKS];
    memset(table, 0, sizeof(table));
    for (int r = 0; r < group->world_size; r++)
        table[r] = range->peers[r];
    /* On the combine's stream: the row is written before this rank's kernel reads it
     * (nothing queued reads this row: it was free, or drained above). The source is
     * pageable, which the runtime stages before returning. */
    cudaError_t err = cudaMemcpyAsync(cuda->local->registered[EPX_CUDA_MAX_REGISTERED + victim],
                                      table, sizeof(table), cudaMemcpyHostToDevice, stream);
    local = err == cudaSuccess
                ? EPX_SUCCESS
                : EPX_CUDA_ERROR(err, "combine: writing the device table of mapped inputs");
    status = epx__cuda_vote(group, local, "combine", "could not record inputs mapped on demand");
    if (status != EPX_SUCCESS) {
        epx__cuda_ipc_range_unmap(&cuda->ipc_cache, range);
        return status;
    }
    epx__cuda_auto_slot_t *slot = &au->slots[victim];
    slot->mine = *offer;
    slot->range = range;
    slot->occupied = 1;
    slot->last_use = now;
    return EPX_SUCCESS;
}

/* Whether this rank can offer x's allocation, and which it is (0: copy x in). */
static int candidate(epx__cuda_buffer_t *cuda, const epx_tensor_t *x, int64_t rows,
                     epx__cuda_ipc_allocation_t *a)
{
    if (rows <= 0)
        return 0;
    uintptr_t first = (uintptr_t)x->data;
    int64_t pitch = epx__tensor_row_stride(x) * 2;
    uintptr_t end = first + (uintptr_t)((rows - 1) * pitch + cuda->shape.hidden * 2);
    if (first % 16 != 0 || pitch % 16 != 0)
        return 0;
    if (!epx__cuda_ipc_find_allocation(x->data, a))
        return 0;
    if (end > a->base + a->bytes)
        return 0;
    if (a->base == cuda->autoreg.refused_base && a->id == cuda->autoreg.refused_id)
        return 0; /* known to have no IPC handle */
    return 1;
}

/* This rank's record: whether it needs a mapping, which slot it reads. */
static epx__cuda_auto_record_t make_record(epx__cuda_buffer_t *cuda, const epx_tensor_t *x,
                                           int64_t rows, cudaStream_t stream, int placed,
                                           epx__cuda_ipc_allocation_t *a)
{
    epx__cuda_auto_t *au = &cuda->autoreg;
    epx__cuda_auto_record_t mine = {0, -1, 0, 0};
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    /* A query that fails (the legacy stream while another stream captures, for one)
     * counts as capturing: nothing is mapped, x is copied in. */
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
        (void)cudaGetLastError();
        capture = cudaStreamCaptureStatusActive;
    }
    mine.capturing = capture != cudaStreamCaptureStatusNone;
    if (placed || mine.capturing || !candidate(cuda, x, rows, a))
        return mine;
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++)
        if (slot_holds(&au->slots[i], a))
            mine.used = i;
    if (mine.used >= 0)
        return mine;
    if (!epx__cuda_ipc_exportable(a->base)) {
        if (au->refused_base == 0)
            EPX_WARN(EPX_SUBSYS_OPS,
                     "combine: x (%p) lies in an allocation without a CUDA IPC handle "
                     "(cudaMallocAsync or VMM memory, such as PyTorch's expandable segments): "
                     "it is copied into the buffer; allocate with cudaMalloc to have it read "
                     "in place",
                     x->data);
        au->refused_base = a->base;
        au->refused_id = a->id;
        return mine;
    }
    mine.want = 1;
    mine.stale = stale_slots(au);
    return mine;
}

/* Publish this rank's record of call `now`, wait for every rank's, plan from them. */
static epx_status_t exchange(epx__cuda_buffer_t *cuda, const epx__cuda_auto_record_t *mine,
                             int me, int world, uint64_t now, epx__cuda_auto_plan_t *plan)
{
    epx__shm_t *shm = cuda->autoreg.shm;
    epx__cuda_auto_record_t all[EPX_CUDA_MAX_RANKS];
    ((epx__cuda_auto_record_t *)epx__shm_peer(shm, me))[now & 1] = *mine;
    EPX_CHECK(epx__shm_barrier(shm, "combine (exchanging inputs mapped on demand)"));
    for (int r = 0; r < world; r++)
        all[r] = ((const epx__cuda_auto_record_t *)epx__shm_peer(shm, r))[now & 1];
    epx__cuda_auto_plan(&cuda->autoreg, all, world, plan);
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_auto_locate(epx_buffer_t buffer, const epx_tensor_t *x, int64_t rows,
                                   cudaStream_t stream, int placed, int32_t *region,
                                   int64_t *offset, int64_t *stride)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__cuda_auto_t *au = &cuda->autoreg;
    int world = buffer->group->world_size;
    if (!au->on)
        return EPX_SUCCESS;
    uint64_t now = ++au->calls;
    epx__cuda_ipc_allocation_t a;
    memset(&a, 0, sizeof(a));
    epx__cuda_auto_record_t mine = make_record(cuda, x, rows, stream, placed, &a);
    epx__cuda_auto_plan_t plan;
    EPX_CHECK(exchange(cuda, &mine, buffer->group->rank, world, now, &plan));
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++)
        if ((plan.used & (1u << i)) != 0)
            au->slots[i].last_use = now;
    if (mine.used >= 0 && (plan.stale & (1u << mine.used)) != 0) {
        mine.used = -1;
        mine.want = 1;
    }
    if (plan.map) {
        /* Every rank enters the votes below, or none: a peer that failed after it
         * arrived above (a timeout there, another thread's abort) publishes its failure,
         * which ends this barrier on every rank. */
        EPX_CHECK(epx__shm_barrier(au->shm, "combine (before mapping inputs on demand)"));
        epx__cuda_ipc_allocation_t offer;
        memset(&offer, 0, sizeof(offer));
        if (mine.want && plan.victim >= 0)
            offer = a;
        epx_status_t status = map_round(buffer, plan.stale, plan.victim, &offer, stream, now);
        if (status != EPX_SUCCESS) {
            if (fatal(status))
                return status;
            turn_off(cuda, epx_last_error());
            return EPX_SUCCESS;
        }
        if (mine.want && plan.victim >= 0)
            mine.used = plan.victim;
    }
    if (mine.used < 0)
        return EPX_SUCCESS;
    *region = 1 + EPX_CUDA_MAX_REGISTERED + mine.used;
    *offset = (int64_t)((uintptr_t)x->data - au->slots[mine.used].mine.base);
    *stride = epx__tensor_row_stride(x) * 2;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_auto_purge(epx_buffer_t buffer, epx_status_t local)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__cuda_auto_t *au = &cuda->autoreg;
    epx_group_t group = buffer->group;
    if (!au->on)
        return local;
    struct {
        int32_t status; /* the vote's */
        uint32_t stale;
    } vote = {0, local == EPX_SUCCESS ? stale_slots(au) : 0}, all[EPX_CUDA_MAX_RANKS];
    epx_status_t status = epx__bootstrap_vote(group->bootstrap, group->world_size, local, &vote,
                                              all, sizeof(vote), "buffer_register", "failed");
    if (status != EPX_SUCCESS)
        return status;
    uint32_t stale = 0;
    for (int r = 0; r < group->world_size; r++)
        stale |= all[r].stale & AUTO_SLOT_MASK;
    if (stale == 0)
        return EPX_SUCCESS;
    status = map_round(buffer, stale, -1, NULL, NULL, 0);
    if (status == EPX_SUCCESS || fatal(status))
        return status;
    turn_off(cuda, epx_last_error()); /* every slot closed: the registration may go on */
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_auto_create(epx_buffer_t buffer)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__transport_ranks_t ranks = epx__group_ranks(buffer->group);
    _Static_assert(2 * sizeof(epx__cuda_auto_record_t) <= 4096,
                   "two records fit the shared page");
    if (ranks.world_size > EPX_CUDA_MAX_RANKS) {
        EPX_WARN(EPX_SUBSYS_OPS, "buffer_create: auto_register takes at most %d ranks; it is "
                                 "off for this buffer and combines copy x into the buffer",
                 EPX_CUDA_MAX_RANKS);
        cuda->autoreg.on = 0;
        return EPX_SUCCESS;
    }
    if (epx__shm_create(&ranks, 4096, &cuda->autoreg.shm) == EPX_SUCCESS)
        return EPX_SUCCESS;
    cuda->autoreg.shm = NULL;
    char why[256];
    snprintf(why, sizeof(why), "%s", epx_last_error());
    epx__clear_error();
    /* Every live rank failed alike (the set-up's rounds). Memory the ranks cannot share
     * (several hosts) turns the feature off; a peer gone during the set-up fails the
     * buffer, as it would have failed its first operation: a vote tells the two apart. */
    epx_status_t status = epx__bootstrap_barrier(buffer->group->bootstrap);
    if (status != EPX_SUCCESS)
        return status;
    EPX_WARN(EPX_SUBSYS_OPS,
             "buffer_create: auto_register needs the ranks' host shared memory (%s); it is "
             "off for this buffer and combines copy x into the buffer",
             why);
    cuda->autoreg.on = 0;
    return EPX_SUCCESS;
}

void epx__cuda_auto_release(epx__cuda_buffer_t *cuda)
{
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        epx__cuda_ipc_range_unmap(&cuda->ipc_cache, cuda->autoreg.slots[i].range);
        memset(&cuda->autoreg.slots[i], 0, sizeof(cuda->autoreg.slots[i]));
    }
    epx__shm_destroy(cuda->autoreg.shm);
    cuda->autoreg.shm = NULL;
}
