/*
 * Caller memory mapped by the peers over CUDA IPC (see ipc.h, epx__cuda_ipc_range_map).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "transport/cuda_ipc/ipc.h"
#include "transport/cuda_status.h"

/* One peer allocation opened in this process, shared by the ranges that lie in it. */
struct epx__cuda_ipc_opened {
    int rank;
    cudaIpcMemHandle_t handle;
    unsigned long long id; /* the exporter's allocation id */
    char *base;
    int refs;
    epx__cuda_ipc_opened_t *next;
};

typedef struct {
    int32_t status; /* set by the vote */
    int32_t device;
    uint64_t offset; /* of the range in its allocation */
    uint64_t bytes;
    unsigned long long id; /* the allocation's (epx__cuda_ipc_allocation) */
    cudaIpcMemHandle_t handle;
} range_vote_t;

/* cuMemGetAddressRange and cuPointerGetAttribute through the runtime's driver entry
 * point (the library does not link the driver library itself, so that it loads on
 * machines without one). */
typedef int (*get_address_range_fn)(unsigned long long *base, size_t *size,
                                    unsigned long long ptr);
typedef int (*get_pointer_attribute_fn)(void *data, int attribute, unsigned long long ptr);

/* CU_POINTER_ATTRIBUTE_BUFFER_ID (cuda.h): an id no other allocation of the process
 * gets, not even a later one at the same address. */
#define EPX_CU_POINTER_ATTRIBUTE_BUFFER_ID 7

static void *driver_function(const char *name)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return fn;
}

/* 0, or the failing driver call's name (its code in *rc). */
static const char *lookup(const void *ptr, epx__cuda_ipc_allocation_t *allocation, int *rc)
{
    memset(allocation, 0, sizeof(*allocation));
    static get_address_range_fn get_range;
    static get_pointer_attribute_fn get_attribute;
    if (get_range == NULL)
        get_range = (get_address_range_fn)driver_function("cuMemGetAddressRange");
    if (get_attribute == NULL)
        get_attribute = (get_pointer_attribute_fn)driver_function("cuPointerGetAttribute");
    *rc = -1;
    if (get_range == NULL)
        return "cuMemGetAddressRange (not in the driver)";
    if (get_attribute == NULL)
        return "cuPointerGetAttribute (not in the driver)";
    unsigned long long base = 0, id = 0;
    size_t size = 0;
    *rc = get_range(&base, &size, (unsigned long long)(uintptr_t)ptr);
    if (*rc != 0)
        return "cuMemGetAddressRange";
    *rc = get_attribute(&id, EPX_CU_POINTER_ATTRIBUTE_BUFFER_ID,
                        (unsigned long long)(uintptr_t)ptr);
    if (*rc != 0)
        return "cuPointerGetAttribute(BUFFER_ID)";
    allocation->base = (uintptr_t)base;
    allocation->bytes = size;
    allocation->id = id;
    return NULL;
}

epx_status_t epx__cuda_ipc_allocation(const char *op, const void *ptr,
                                      epx__cuda_ipc_allocation_t *allocation)
{
    int rc;
    const char *failed = lookup(ptr, allocation, &rc);
    if (failed != NULL)
        return EPX_ERROR(EPX_ERR_CUDA, "%s: %p is not in a device allocation: %s failed (%d)",
                         op, ptr, failed, rc);
    return EPX_SUCCESS;
}

int epx__cuda_ipc_find_allocation(const void *ptr, epx__cuda_ipc_allocation_t *allocation)
{
    int rc;
    return lookup(ptr, allocation, &rc) == NULL;
}

int epx__cuda_ipc_exportable(uintptr_t base)
{
    cudaIpcMemHandle_t handle;
    int ok = cudaIpcGetMemHandle(&handle, (void *)base) == cudaSuccess;
    (void)cudaGetLastError();
    return ok;
}

/* The allocation holding [ptr, ptr + bytes) and the range's offset in it, with its handle. */
static epx_status_t describe_range(const char *op, void *ptr, size_t bytes, range_vote_t *vote)
{
    struct cudaPointerAttributes attr;
    EPX_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr),
                   "%s: cudaPointerGetAttributes(%p)", op, ptr);
    if (attr.type != cudaMemoryTypeDevice)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %p is not device memory (CUDA memory type %d)", op, ptr,
                         (int)attr.type);
    epx__cuda_ipc_allocation_t allocation;
    EPX_CHECK(epx__cuda_ipc_allocation(op, ptr, &allocation));
    uintptr_t base = allocation.base;
    size_t size = allocation.bytes;
    uint64_t offset = (uint64_t)(uintptr_t)ptr - base;
    if (offset + bytes > size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: [%p, +%zu) runs past the end of its allocation (%zu bytes from "
                         "%p): a range must lie in one allocation",
                         op, ptr, bytes, size, (void *)(uintptr_t)base);
    EPX_CUDA_CHECK(cudaIpcGetMemHandle(&vote->handle, (void *)(uintptr_t)base),
                   "%s: cudaIpcGetMemHandle of the allocation holding %p (memory from "
                   "cudaMallocAsync or the VMM API, such as PyTorch's expandable segments, has "
                   "none: use memory from cudaMalloc)",
                   op, ptr);
    /* Measured on an H200 (docs/PERFORMANCE.md): peers read an allocation whose size is
     * not a multiple of 2 MiB through CUDA IPC up to 1.7x slower than one that is (in its
     * own process it reads alike; the driver's reason is not known). Allowed, but said
     * once per registration. */
    if (size % ((size_t)2 << 20) != 0)
        EPX_WARN(EPX_SUBSYS_TRANSPORT,
                 "%s: the allocation holding %p is %zu bytes, not a multiple of 2 MiB: peers "
                 "read such memory up to 1.7x slower; allocate in multiples of 2 MiB "
                 "(PyTorch's caching allocator does)",
                 op, ptr, size);
    vote->offset = offset;
    vote->bytes = bytes;
    vote->id = allocation.id;
    return EPX_SUCCESS;
}

/* Rank r's allocation, opened once in this process. */
static epx_status_t open_allocation(const char *op, epx__cuda_ipc_cache_t *cache, int r,
                                    const range_vote_t *vote, epx__cuda_ipc_opened_t **out)
{
    for (epx__cuda_ipc_opened_t *o = cache->head; o != NULL; o = o->next)
        if (o->rank == r && o->id == vote->id &&
            memcmp(&o->handle, &vote->handle, sizeof(vote->handle)) == 0) {
            o->refs++;
            *out = o;
            return EPX_SUCCESS;
        }
    epx__cuda_ipc_opened_t *o = calloc(1, sizeof(*o));
    if (o == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    void *base = NULL;
    cudaError_t err = cudaIpcOpenMemHandle(&base, vote->handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
        free(o);
        return EPX_CUDA_ERROR(err,
                              "%s: opening rank %d's range (device %d) with "
                              "cudaIpcOpenMemHandle",
                              op, r, vote->device);
    }
    o->rank = r;
    o->handle = vote->handle;
    o->id = vote->id;
    o->base = base;
    o->refs = 1;
    o->next = cache->head;
    cache->head = o;
    *out = o;
    return EPX_SUCCESS;
}

static void release_allocation(epx__cuda_ipc_cache_t *cache, epx__cuda_ipc_opened_t *opened)
{
    if (opened == NULL || --opened->refs > 0)
        return;
    for (epx__cuda_ipc_opened_t **p = &cache->head; *p != NULL; p = &(*p)->next)
        if (*p == opened) {
            *p = opened->next;
            break;
        }
    (void)cudaIpcCloseMemHandle(opened->base);
    (void)cudaGetLastError();
    free(opened);
}

static epx_status_t open_ranges(const char *op, epx__cuda_ipc_cache_t *cache,
                                epx__cuda_ipc_range_t *range, int me, const int *reach,
                                const range_vote_t *votes)
{
    for (int r = 0; r < range->world_size; r++) {
        if (r == me || !reach[r] || votes[r].bytes == 0)
            continue;
        EPX_CHECK(open_allocation(op, cache, r, &votes[r], &range->opened[r]));
        range->peers[r] = range->opened[r]->base + votes[r].offset;
    }
    return EPX_SUCCESS;
}

epx_status_t epx__cuda_ipc_range_map(const epx__transport_ranks_t *ranks, epx__cuda_ipc_cache_t *cache,
                                     void *ptr, size_t bytes, const int *reach,
                                     epx_status_t local_status, const char *op,
                                     epx__cuda_ipc_range_t **out)
{
    int R = ranks->world_size;
    epx__cuda_ipc_range_t *range = calloc(1, sizeof(*range));
    range_vote_t *votes = calloc((size_t)R, sizeof(*votes));
    range_vote_t *results = calloc((size_t)R, sizeof(*results));
    if (range != NULL) {
        range->world_size = R;
        range->peers = calloc((size_t)R, sizeof(char *));
        range->opened = calloc((size_t)R, sizeof(*range->opened));
    }
    if (range == NULL || votes == NULL || results == NULL || range->peers == NULL ||
        range->opened == NULL) {
        free(votes);
        free(results);
        epx__cuda_ipc_range_unmap(cache, range);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    }
    range_vote_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.device = ranks->device;
    epx_status_t status = local_status;
    if (status == EPX_SUCCESS && bytes > 0)
        status = describe_range(op, ptr, bytes, &mine);
    status = epx__bootstrap_vote(ranks->bootstrap, R, status, &mine, votes, sizeof(mine),
                                 op, "could not export its range");
    if (status == EPX_SUCCESS) {
        range->peers[ranks->rank] = bytes > 0 ? ptr : NULL;
        range_vote_t opened;
        memset(&opened, 0, sizeof(opened));
        opened.device = ranks->device;
        status = epx__bootstrap_vote(ranks->bootstrap, R,
                                     open_ranges(op, cache, range, ranks->rank, reach, votes),
                                     &opened, results, sizeof(opened), op,
                                     "could not map its peers' ranges");
    }
    free(votes);
    free(results);
    if (status != EPX_SUCCESS) {
        epx__cuda_ipc_range_unmap(cache, range);
        return status;
    }
    *out = range;
    return EPX_SUCCESS;
}

void epx__cuda_ipc_range_unmap(epx__cuda_ipc_cache_t *cache, epx__cuda_ipc_range_t *range)
{
    if (range == NULL)
        return;
    if (range->opened != NULL)
        for (int r = 0; r < range->world_size; r++)
            release_allocation(cache, range->opened[r]);
    free(range->opened);
    free(range->peers);
    free(range);
}
