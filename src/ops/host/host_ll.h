/*
 * Low-latency mode on the host backend (docs/LOW_LATENCY.md). Internal to src/ops/host.
 *
 * A second shared-memory segment per rank, made only when max_low_latency_tokens > 0
 * (M; R ranks, L local experts, k top-k, S = hidden / 128 scale columns):
 *   flags   uint64 [4 kinds][2 slots][R]: dispatch arrival (raised by the source),
 *           dispatch release (raised by the receiver in the sender's segment when it has
 *           read the slot), and the same two for combine. Values are per-slot sequence
 *           numbers, so nothing is ever cleared.
 *   slot b  staging that peers write into, [L][R][M] per (expert, source): x rows
 *           (bf16-sized, or fp8-sized when config.low_latency_dtype is FP8_E4M3),
 *           scales, source token, top-k position, and counts [L][R]; the packed results
 *           (recv_x [L][M*R], scales, counts, src_info, layout ranges, and the internal
 *           source rank / top-k position of each row); the zero-copy combine input
 *           [L][M*R][hidden] bf16; the combine staging [M][k][hidden] bf16 that the
 *           experts' ranks write a token's rows into.
 * A sender writes rows straight into the receiver's staging, then raises the flag;
 * the receive waits for the flags of the unmasked peers and packs the rows in order of
 * source rank, then source token. Before reusing a slot a sender waits for the
 * receiver's release of that slot's previous use.
 */
#ifndef EPX_OPS_HOST_HOST_LL_H
#define EPX_OPS_HOST_HOST_LL_H

#include <stddef.h>
#include <stdint.h>

#include "ops/backend.h"
#include "transport/shm/shm.h"

enum {
    EPX__LL_FLAG_DISPATCH = 0,
    EPX__LL_FLAG_DISPATCH_DONE = 1,
    EPX__LL_FLAG_COMBINE = 2,
    EPX__LL_FLAG_COMBINE_DONE = 3
};

typedef struct {
    int64_t max_tokens; /* M */
    int64_t rows;       /* M * R */
    int64_t scale_cols; /* hidden / 128, or 0 */
    size_t x_row_bytes; /* a staged or received dispatch row: hidden * 2 (bf16), or hidden
                         * when config.low_latency_dtype is FP8_E4M3 */
    size_t flags;
    size_t slot[2];
    /* Offsets inside a slot. */
    size_t stage_count, stage_x, stage_scales, stage_token, stage_topk;
    size_t recv_x, recv_scales, recv_count, recv_src_info, recv_range, recv_src_rank, recv_topk;
    size_t combine_in, combine_stage;
    size_t total;
} epx__host_ll_layout_t;

/* What a step in a slot remembers between its calls (this rank only). */
typedef struct {
    uint64_t dispatch_seq;
    uint64_t combine_seq;
    int64_t num_tokens;
    int use_fp8, use_ue8m0;
    int64_t masked_entries;
    uint8_t *peers;  /* [R] ranks this operation exchanges with (unmasked at its send) */
    uint8_t *failed; /* [R] scratch of the waits */
    epx_tensor_t topk_idx, topk_weights, out; /* combine's, for its receive */
    int32_t *recv_stats; /* dispatch's cumulative_local_expert_recv_stats, or NULL */
    /* The wait_recv_cost_stats of the dispatch and of the combine, or NULL: kept for
     * their receives (EPX_LL_SEND_ONLY), like recv_stats; and the time they count from
     * (epx__host_ll_wait_start). */
    int64_t *dispatch_wait_stats, *combine_wait_stats;
    int64_t dispatch_wait_start, combine_wait_start;
} epx__host_ll_slot_t;

typedef struct epx__host_ll {
    epx__shm_t *shm;
    epx__host_ll_layout_t layout;
    uint8_t *mask;           /* [R] 1 = masked */
    epx__host_ll_slot_t slots[2];
    int32_t *send_counts;    /* [E] dispatch scratch */
    uint8_t *cast_row;       /* [hidden] fp8 scratch */
    float *cast_scales;      /* [S] */
    float *accumulator;      /* [hidden] */
    uint64_t **wait_flags;   /* [R] */
    int64_t *arrived_ns;     /* [R] when a timed wait saw each flag */
} epx__host_ll_t;

epx_status_t epx__host_ll_layout(int world_size, const epx_buffer_config_t *config,
                                 epx__host_ll_layout_t *layout);
/* Collective (when max_low_latency_tokens > 0); NULL-safe destroy. */
epx_status_t epx__host_ll_create(epx_buffer_t buffer, epx__host_ll_t **ll);
void epx__host_ll_destroy(epx__host_ll_t *ll);
/* Local: the state and scratch of epx__host_ll_create, without the shared memory. */
epx_status_t epx__host_ll_alloc(epx_buffer_t buffer, epx__host_ll_t **ll);

/*
 * Rejoin (host_ll_rejoin.c, the backend's ll_rejoin; docs/STABILITY.md): collective over
 * `ranks`, a new rendezvous of every rank. A survivor's `buffer` is its running buffer; a
 * newcomer's (joiners[rank] = 1) is new, with impl NULL, and gets a host buffer with
 * low-latency memory only.
 */
epx_status_t epx__host_ll_rejoin(epx_buffer_t buffer, const epx__transport_ranks_t *ranks,
                                 const unsigned char *joiners);

static inline char *epx__host_ll_slot(const epx__host_ll_t *ll, int rank, int slot)
{
    return (char *)epx__shm_peer(ll->shm, rank) + ll->layout.slot[slot];
}

static inline uint64_t *epx__host_ll_flag(const epx__host_ll_t *ll, int owner, int kind, int slot,
                                          int peer)
{
    int world = ll->layout.max_tokens > 0 ? (int)(ll->layout.rows / ll->layout.max_tokens) : 1;
    return (uint64_t *)((char *)epx__shm_peer(ll->shm, owner) + ll->layout.flags) +
           ((size_t)(kind * 2 + slot) * (size_t)world + (size_t)peer);
}

/*
 * Wait for flag `kind` of `slot` in this rank's segment from every rank in s->peers to
 * reach `target`. Peers masked since the step began are dropped from s->peers first;
 * ranks that fail the wait are masked, dropped and noted in s->failed. A receive's wait
 * with `stats` (not NULL) also adds to stats[r] the nanoseconds from `start` (0: now)
 * until rank r's flag was seen, for each rank the step still exchanges with
 * (wait_recv_cost_stats: masked and failed ranks add nothing); sends pass NULL.
 */
epx_status_t epx__host_ll_wait(epx__host_ll_t *ll, int rank, int world, int kind, int slot,
                               uint64_t target, const char *stage, epx__host_ll_slot_t *s,
                               int64_t start, int64_t *stats);

/*
 * What a send keeps as the start that its receive's wait_recv_cost_stats count from: a
 * call without EPX_LL_SEND_ONLY counts from its own start (its send and receive are one,
 * as on the GPU, where one launch does both), so now; else 0: the receive's start.
 */
static inline int64_t epx__host_ll_wait_start(const void *stats, uint32_t flags)
{
    return stats != NULL && !(flags & EPX_LL_SEND_ONLY) ? epx__now_ns() : 0;
}


/*
 * A receive's last step: hand `slot` back (flag `kind` = `seq`) to every rank the step
 * exchanged with, those whose wait failed included.
 */
void epx__host_ll_release(epx__host_ll_t *ll, const epx__host_ll_slot_t *s, int rank, int world,
                          int kind, int slot, uint64_t seq);

/*
 * One token row to fp8 e4m3 with a scale per 128 channels (include/epx.h): `row`
 * [hidden] bf16 bits; `out` [hidden] e4m3 bytes; `scales` [hidden/128] fp32 scales.
 */
void epx__host_ll_cast_fp8(const uint16_t *row, int64_t hidden, int round_scale, uint8_t *out,
                           float *scales);

epx_status_t epx__host_ll_dispatch(epx_buffer_t buffer, int slot,
                                   const epx_ll_dispatch_args_t *args,
                                   epx_ll_dispatch_result_t *result, void *stream);
epx_status_t epx__host_ll_dispatch_receive(epx_buffer_t buffer, int slot, void *stream);
epx_status_t epx__host_ll_combine(epx_buffer_t buffer, int slot, const epx_ll_combine_args_t *args,
                                  void *stream);
epx_status_t epx__host_ll_combine_receive(epx_buffer_t buffer, int slot,
                                          epx_ll_combine_result_t *result, void *stream);
epx_status_t epx__host_ll_combine_buffer(epx_buffer_t buffer, int slot, void **base);
epx_status_t epx__host_ll_mask_rank(epx_buffer_t buffer, int rank);
void epx__host_ll_get_masked(epx_buffer_t buffer, int32_t *mask);

#endif /* EPX_OPS_HOST_HOST_LL_H */
