/*
 * Combine inputs mapped on demand (config.auto_register; docs/DESIGN.md, "Combine inputs
 * mapped on demand"). A combine whose x lies outside the buffer and outside the ranges
 * of epx_buffer_register would copy x into the buffer first: a second pass over every
 * received row. With auto_register on, the allocation holding x is mapped by every peer
 * the first time it is seen (as epx_buffer_register would, over CUDA IPC) and read in
 * place from then on. An engine's expert outputs come from a caching allocator that
 * hands back the same allocations step after step, so after the first steps every
 * combine hits.
 *
 * Every combine, every rank: one exchange of a few bytes (what each rank's x needs), so
 * that all ranks take the same collective steps:
 *   - each rank looks its x's allocation up among its slots (start, size and the
 *     driver's allocation id, which a new allocation at an old address does not share);
 *   - if some rank's allocation is new, every rank maps every new allocation in one
 *     slot: a free slot, else the one read longest ago (its mappings closed after this
 *     rank's device is idle), never one read by this combine;
 *   - a rank whose x is mapped publishes its region and offset, as for a registered
 *     range; the others copy x in as before.
 * A rank inside stream capture neither maps nor reads a slot (a graph keeps the region it
 * was captured with, and slots are evicted); memory without a CUDA IPC handle
 * (cudaMallocAsync, VMM such as PyTorch's expandable segments) is copied in, said once.
 * A mapping that fails turns the feature off on every rank, with a warning.
 */
#include <stdlib.h>
#include <string.h>

#include "ops/cuda/cuda_backend.h"
#include "ops/group.h"

typedef struct {
    int32_t status; /* the vote's */
    int32_t want;   /* this rank's x is in an allocation no slot holds */
    int32_t used;   /* the slot this rank's x is read from this call, or -1 */
    uint32_t stale; /* slots holding an allocation of this rank that is gone (freed) */
} auto_vote_t;

/*
 * Slots whose allocation of this rank is gone (freed; maybe another allocation at its
 * address now). Peers keep such an allocation open until the slot is evicted, and CUDA
 * refuses to open a new allocation of this rank over an address range they still hold
 * open ("resource already mapped"): so before anything new of this rank is mapped, the
 * slots holding its freed allocations are evicted.
 */
static uint32_t stale_slots(const epx__cuda_auto_t *au)
{
    uint32_t stale = 0;
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        const epx__cuda_ipc_allocation_t *m = &au->slots[i].mine;
        epx__cuda_ipc_allocation_t now;
        if (m->bytes == 0)
            continue;
        if (epx__cuda_ipc_allocation((void *)m->base, &now) != EPX_SUCCESS) {
            epx__clear_error();
            stale |= 1u << i;
        } else if (now.base != m->base || now.bytes != m->bytes || now.id != m->id) {
            stale |= 1u << i;
        }
    }
    return stale;
}

static int slot_holds(const epx__cuda_auto_slot_t *slot, const epx__cuda_ipc_allocation_t *a)
{
    return slot->mine.bytes != 0 && slot->mine.base == a->base && slot->mine.bytes == a->bytes &&
           slot->mine.id == a->id;
}

/* A free slot, else the one read longest ago but not in call `now`; -1 when every slot
 * is read in this call. The same answer on every rank (from shared state only). */
static int pick_slot(const epx__cuda_auto_t *au, uint64_t now)
{
    int victim = -1;
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        if (!au->slots[i].occupied)
            return i;
        if (au->slots[i].last_use != now &&
            (victim < 0 || au->slots[i].last_use < au->slots[victim].last_use))
            victim = i;
    }
    return victim;
}

/* Close slot `i`'s mappings. Local: this rank's queued kernels may read them, so the
 * device is drained first; the peers' allocations stay theirs. */
static epx_status_t evict(epx__cuda_buffer_t *cuda, int i)
{
    epx__cuda_auto_slot_t *slot = &cuda->autoreg.slots[i];
    EPX_CUDA_CHECK(cudaDeviceSynchronize(), "combine: waiting for queued work before "
                                            "releasing an input mapped on demand");
    EPX_CHECK(epx__cuda_write_range_row(cuda, EPX_CUDA_MAX_REGISTERED + i, NULL));
    epx__cuda_ipc_range_unmap(&cuda->ipc_cache, slot->range);
    memset(slot, 0, sizeof(*slot));
    return EPX_SUCCESS;
}

/* Whether this rank can offer x's allocation: what it is, or 0 (copy x in). */
static int candidate(epx__cuda_buffer_t *cuda, const epx_tensor_t *x, int64_t rows,
                     cudaStream_t stream, epx__cuda_ipc_allocation_t *a)
{
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (rows <= 0 || cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return 0;
    }
    uintptr_t first = (uintptr_t)x->data;
    int64_t pitch = epx__tensor_row_stride(x) * 2;
    uintptr_t end = first + (uintptr_t)((rows - 1) * pitch + cuda->shape.hidden * 2);
    if (first % 16 != 0 || pitch % 16 != 0)
        return 0;
    if (epx__cuda_ipc_allocation(x->data, a) != EPX_SUCCESS) {
        epx__clear_error();
        return 0;
    }
    return end <= a->base + a->bytes;
}

/* Map every rank's new allocation into slot `i` (collective), evicting it first. */
static epx_status_t map_slot(epx_buffer_t buffer, int i, const epx__cuda_ipc_allocation_t *mine,
                             cudaStream_t stream, uint64_t now)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx_group_t group = buffer->group;
    epx__cuda_auto_slot_t *slot = &cuda->autoreg.slots[i];
    epx_status_t local = slot->occupied ? evict(cuda, i) : EPX_SUCCESS;
    int *reach = calloc((size_t)group->world_size, sizeof(int));
    if (local == EPX_SUCCESS && reach == NULL)
        local = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "combine: out of host memory");
    for (int r = 0; reach != NULL && r < group->world_size; r++)
        reach[r] = r != group->rank && cuda->peer_bases[r] != NULL;
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    epx__cuda_ipc_range_t *range = NULL;
    epx_status_t status =
        epx__cuda_ipc_range_map(&ranks, &cuda->ipc_cache, (void *)mine->base, mine->bytes, reach,
                                local, &range);
    free(reach);
    if (status != EPX_SUCCESS)
        return status;
    char *table[EPX_CUDA_MAX_RANKS];
    memset(table, 0, sizeof(table));
    for (int r = 0; r < cuda->shape.world_size; r++)
        table[r] = range->peers[r];
    /* On the combine's stream: the row is written before this rank's kernel reads it
     * (nothing earlier reads this row: it was free or drained). */
    cudaError_t err = cudaMemcpyAsync(cuda->local->registered[EPX_CUDA_MAX_REGISTERED + i],
                                      table, sizeof(table), cudaMemcpyHostToDevice, stream);
    if (err != cudaSuccess) {
        epx__cuda_ipc_range_unmap(&cuda->ipc_cache, range);
        return EPX_CUDA_ERROR(err, "combine: writing the device table of mapped inputs");
    }
    slot->mine = *mine;
    slot->range = range;
    slot->occupied = 1;
    slot->last_use = now;
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_auto_locate(epx_buffer_t buffer, epx_status_t local, const epx_tensor_t *x,
                                   int64_t rows, cudaStream_t stream, int placed,
                                   int32_t *region, int64_t *offset, int64_t *stride)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__cuda_auto_t *au = &cuda->autoreg;
    epx_group_t group = buffer->group;
    if (!au->on)
        return EPX_SUCCESS;
    uint64_t now = ++au->calls;

    auto_vote_t mine = {0, 0, -1, 0};
    epx__cuda_ipc_allocation_t a;
    memset(&a, 0, sizeof(a));
    if (local == EPX_SUCCESS && !placed && candidate(cuda, x, rows, stream, &a)) {
        for (int i = 0; i < EPX_CUDA_AUTO_SLOTS && mine.used < 0; i++)
            if (slot_holds(&au->slots[i], &a))
                mine.used = i;
        if (mine.used < 0 && a.base == au->refused_base && a.id == au->refused_id) {
            /* known to have no IPC handle: copied in */
        } else if (mine.used < 0 && !epx__cuda_ipc_exportable(a.base)) {
            if (au->refused_base == 0)
                EPX_WARN(EPX_SUBSYS_OPS,
                         "combine: x (%p) lies in an allocation without a CUDA IPC handle "
                         "(cudaMallocAsync or VMM memory, such as PyTorch's expandable "
                         "segments): it is copied into the buffer; allocate with cudaMalloc "
                         "to have it read in place",
                         x->data);
            au->refused_base = a.base;
            au->refused_id = a.id;
        } else if (mine.used < 0) {
            mine.want = 1;
        }
    }
    auto_vote_t *all = calloc((size_t)group->world_size, sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "combine: out of host memory");
    if (mine.want)
        mine.stale = stale_slots(au);
    epx_status_t status = epx__bootstrap_vote(group->bootstrap, group->world_size, local, &mine,
                                              all, sizeof(mine), "combine", "failed");
    uint32_t stale = 0;
    for (int r = 0; status == EPX_SUCCESS && r < group->world_size; r++)
        stale |= all[r].stale & ((1u << EPX_CUDA_AUTO_SLOTS) - 1);
    /* A rank whose x sits in a slot evicted now maps it again (every rank sees that). */
    int wanted = 0;
    for (int r = 0; status == EPX_SUCCESS && r < group->world_size; r++) {
        int used = all[r].used;
        if (used >= 0 && used < EPX_CUDA_AUTO_SLOTS && (stale & (1u << used)) == 0)
            au->slots[used].last_use = now;
        wanted |= all[r].want || (used >= 0 && used < EPX_CUDA_AUTO_SLOTS &&
                                  (stale & (1u << used)) != 0);
    }
    free(all);
    EPX_CHECK(status);
    if (mine.used >= 0 && (stale & (1u << mine.used)) != 0) {
        mine.used = -1;
        mine.want = 1;
    }
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS && status == EPX_SUCCESS; i++)
        if ((stale & (1u << i)) != 0 && au->slots[i].occupied)
            status = evict(cuda, i);
    EPX_CHECK(status);

    int victim = wanted ? pick_slot(au, now) : -1;
    if (victim >= 0) {
        epx__cuda_ipc_allocation_t offer;
        memset(&offer, 0, sizeof(offer));
        if (mine.want)
            offer = a;
        status = map_slot(buffer, victim, &offer, stream, now);
        if (status != EPX_SUCCESS) {
            /* Every rank got a failure from the same votes: all turn it off alike. */
            au->on = 0;
            EPX_WARN(EPX_SUBSYS_OPS,
                     "combine: mapping inputs on demand failed (%s); auto_register is off for "
                     "this buffer from now on and combines copy x into the buffer",
                     epx_last_error());
            epx__clear_error();
            return EPX_SUCCESS;
        }
        if (mine.want)
            mine.used = victim;
    }
    if (mine.used < 0)
        return EPX_SUCCESS;
    *region = 1 + EPX_CUDA_MAX_REGISTERED + mine.used;
    *offset = (int64_t)((uintptr_t)x->data - au->slots[mine.used].mine.base);
    *stride = epx__tensor_row_stride(x) * 2;
    return EPX_SUCCESS;
}

void epx__cuda_auto_failed(epx_buffer_t buffer, epx_status_t status)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    if (cuda == NULL || !cuda->autoreg.on || status == EPX_SUCCESS)
        return;
    int32_t region = 0;
    int64_t offset = 0, stride = 0;
    (void)epx__cuda_auto_locate(buffer, status, NULL, 0, NULL, 1, &region, &offset, &stride);
}

epx_status_t epx__cuda_auto_purge(epx_buffer_t buffer, epx_status_t local)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__cuda_auto_t *au = &cuda->autoreg;
    epx_group_t group = buffer->group;
    if (!au->on)
        return local;
    auto_vote_t mine = {0, 0, -1, local == EPX_SUCCESS ? stale_slots(au) : 0};
    auto_vote_t *all = calloc((size_t)group->world_size, sizeof(*all));
    if (all == NULL && local == EPX_SUCCESS)
        local = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_register: out of host memory");
    if (all == NULL)
        return local; /* peers time out in the vote, naming this rank */
    epx_status_t status = epx__bootstrap_vote(group->bootstrap, group->world_size, local, &mine,
                                              all, sizeof(mine), "buffer_register", "failed");
    uint32_t stale = 0;
    for (int r = 0; status == EPX_SUCCESS && r < group->world_size; r++)
        stale |= all[r].stale & ((1u << EPX_CUDA_AUTO_SLOTS) - 1);
    free(all);
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS && status == EPX_SUCCESS; i++)
        if ((stale & (1u << i)) != 0 && au->slots[i].occupied)
            status = evict(cuda, i);
    return status;
}

void epx__cuda_auto_release(epx__cuda_buffer_t *cuda)
{
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        epx__cuda_ipc_range_unmap(&cuda->ipc_cache, cuda->autoreg.slots[i].range);
        memset(&cuda->autoreg.slots[i], 0, sizeof(cuda->autoreg.slots[i]));
    }
}
