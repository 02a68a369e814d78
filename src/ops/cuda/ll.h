/*
 * Low-latency mode of the CUDA backend, host side (docs/LOW_LATENCY.md). The kernels
 * live in the NVSHMEM plugin (ll_plugin.h), which the NVSHMEM transport loads and sets up
 * (src/transport/nvshmem/nvshmem.h); this side lays out and allocates the memory and
 * launches the kernels.
 *
 * Files: ll_setup.c (plan, create, destroy), ll_ops.c (the epx_ll_* backend entries).
 */
#ifndef EPX_OPS_CUDA_LL_H
#define EPX_OPS_CUDA_LL_H

#include "ops/backend.h"
#include "ops/cuda/ll_plugin.h"

typedef struct {
    int use_fp8, use_ue8m0;
    int64_t tokens;
    int32_t *recv_stats; /* the dispatch's cumulative_local_expert_recv_stats, or NULL */
    int64_t *wait_stats; /* the dispatch's wait_recv_cost_stats, or NULL */
    epx_ll_op_t combine; /* what the combine's receive needs */
    /* Kernels 2: the send's launch also received (a call without EPX_LL_SEND_ONLY), so
     * the backend's receive entry has nothing left to launch. */
    int dispatch_received, combine_received;
} epx__cuda_ll_slot_t;

/*
 * One rank's low-latency settings, as the vote before the symmetric heap gathers them:
 * every rank must run the same kernels (EPX_LL_KERNELS as its config gets them) and give
 * slots back the same way (EPX_LL_RELEASE; 1 with kernels 1).
 */
typedef struct {
    int32_t status; /* the vote's (epx__bootstrap_vote) */
    int32_t kernels;
    int32_t release;
} epx__cuda_ll_vote_t;

/* The lowest rank whose settings differ from rank 0's in votes[world_size], or -1. */
int epx__cuda_ll_settings_differ(const epx__cuda_ll_vote_t *votes, int world_size);

typedef struct epx__cuda_ll {
    const epx_ll_plugin_t *plugin;
    epx_ll_shape_t shape;  /* device addresses */
    size_t sym_bytes, local_bytes;
    void *sym;             /* nvshmem_malloc */
    char *local;           /* cudaMalloc: both slots' results, state, peer table */
    epx_ll_fail_t *fail;   /* host address of the mapped failure record */
    epx__cuda_ll_slot_t slots[2];
    int counted;           /* in the process's count of live low-latency buffers */
    uint64_t *trace;       /* cudaMalloc: the phase trace (EPX_LL_TRACE), or NULL */
} epx__cuda_ll_t;

/*
 * Memory of the low-latency part for this config (0 when max_low_latency_tokens is 0):
 * fills the offsets of `shape` (addresses stay NULL).
 */
epx_status_t epx__cuda_ll_plan(epx_group_t group, const epx_buffer_config_t *config,
                               epx_ll_shape_t *shape, size_t *sym_bytes, size_t *local_bytes);

/*
 * Collective. `status` is this rank's state so far (carried into the group's vote, so
 * every rank fails alike). On success *ll is ready (NULL when the config has no
 * low-latency tokens).
 */
epx_status_t epx__cuda_ll_create(epx_buffer_t buffer, epx_status_t status, epx__cuda_ll_t **ll);
/* NULL-safe. `healthy` = every peer is known to be alive (the free is collective). */
void epx__cuda_ll_destroy(epx__cuda_ll_t *ll, int healthy);

/*
 * The group is being destroyed (the table's group_destroy): when it is the one that set
 * NVSHMEM up, finalise NVSHMEM if every rank agrees it is safe (collective then).
 */
void epx__cuda_ll_group_destroy(epx_group_t group);

/*
 * NVSHMEM for another user of the symmetric heap (internode normal mode): load the
 * plugin and set NVSHMEM up for this group if it is not (collective; `status` is this
 * rank's state so far, carried into the vote). On success the caller holds NVSHMEM
 * until epx__cuda_nvshmem_release (healthy = no peer failed, so finalising stays safe).
 * `sym_bytes` sizes the heap's default when this call sets NVSHMEM up.
 */
epx_status_t epx__cuda_nvshmem_setup(epx_group_t group, size_t sym_bytes, epx_status_t status,
                                     const epx_ll_plugin_t **plugin);
void epx__cuda_nvshmem_release(int healthy);

/* A device-side low-latency failure, once, as buffer->ll_peer_error (not a poison). */
void epx__cuda_ll_poll(epx_buffer_t buffer);

epx_status_t epx__cuda_ll_dispatch(epx_buffer_t buffer, int slot, const epx_ll_dispatch_args_t *args,
                                   epx_ll_dispatch_result_t *result, void *stream);
epx_status_t epx__cuda_ll_dispatch_receive(epx_buffer_t buffer, int slot, void *stream);
epx_status_t epx__cuda_ll_combine(epx_buffer_t buffer, int slot, const epx_ll_combine_args_t *args,
                                  void *stream);
epx_status_t epx__cuda_ll_combine_receive(epx_buffer_t buffer, int slot,
                                          epx_ll_combine_result_t *result, void *stream);
epx_status_t epx__cuda_ll_combine_buffer(epx_buffer_t buffer, int slot, void **base);
epx_status_t epx__cuda_ll_mask_rank(epx_buffer_t buffer, int rank);
void epx__cuda_ll_get_masked(epx_buffer_t buffer, int32_t *mask);
/* The backend's ll_check_wait_stats: only kernels 2 time the receives' waits. */
epx_status_t epx__cuda_ll_check_wait_stats(epx_buffer_t buffer, const char *op);

#endif /* EPX_OPS_CUDA_LL_H */
