/*
 * The host (CPU) backend: docs/DESIGN.md section 2 on host memory, ranks as processes that
 * share POSIX shared memory (src/transport/shm/shm.h). Internal to src/ops/host.
 *
 * Each rank's segment holds, at fixed offsets (epx__host_layout_t):
 *   call area     what this rank is doing now (op, sequence, dtype, which optional
 *                 inputs) and its send counts per destination rank [R] and per global
 *                 expert [E]; peers read it between the two barriers of a call
 *   receive       dispatch rows that peers write straight into, worst case
 *                 N = max_tokens_per_rank * R rows, one array per field ("structure
 *                 of arrays") so a received prefix is returned as tensor views:
 *                 x [N, hidden] (bf16 or fp8, packed by the call's dtype), scales
 *                 [N, hidden/128] fp32, topk idx [N, k] int64, weights [N, k] fp32,
 *                 source rank [N] and source token [N] int32
 *   staging       combine inputs that peers read from: x [N, hidden] bf16, weights
 *                 [N, k] fp32; the x rows are also the zero-copy combine input
 *                 (epx_get_combine_input), which no dispatch writes
 *
 * Ordering: a call's first barrier means "every rank has entered this call", so the
 * previous call's results on every rank may be overwritten; its last barrier means
 * "every rank is done with this call's shared data".
 */
#ifndef EPX_OPS_HOST_HOST_H
#define EPX_OPS_HOST_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "ops/backend.h"
#include "transport/shm/shm.h"

/* Byte offsets of the arrays in one rank's data area (all 64-byte aligned). */
typedef struct {
    int64_t capacity;    /* N: rows of the receive and staging regions */
    int64_t scale_cols;  /* hidden / 128 when hidden % 128 == 0, else 0 */
    size_t call;         /* epx__host_call_t */
    size_t count_rank;   /* int32 [R] */
    size_t count_expert; /* int32 [E] */
    size_t recv_x;
    size_t recv_scales;
    size_t recv_idx;
    size_t recv_weights;
    size_t recv_src_rank;
    size_t recv_src_token;
    size_t stage_x;
    size_t stage_weights;
    size_t total;
} epx__host_layout_t;

typedef enum { EPX__HOST_OP_DISPATCH = 1, EPX__HOST_OP_COMBINE = 2 } epx__host_op_t;

/*
 * What a rank announces at the start of a call. Peers compare it with their own so
 * that ranks calling different operations, or passing inconsistent inputs (fp8 here,
 * bf16 there), fail with a message instead of exchanging garbage.
 */
typedef struct {
    int64_t sequence; /* dispatch and combine calls made on this buffer, this one included */
    int32_t op;       /* epx__host_op_t */
    int32_t cached;
    int32_t x_dtype;
    int32_t has_idx;
    int32_t has_weights;
    int32_t pad;
} epx__host_call_t;

typedef struct {
    epx__shm_t *shm;
    epx__host_layout_t layout;
    int64_t sequence;
    int32_t *route;     /* [max_tokens_per_rank * R] dispatch scratch */
    uint8_t *rank_hit;  /* [R] dispatch scratch */
    float *accumulator; /* [2 * hidden] combine scratch: a node's partial, the total */
    float *weight_sums; /* [2 * num_topk] combine scratch: the same for the weights */
    int *rank_scratch;  /* [2 * R] combine scratch: a token's ranks in order, last entries */
    struct epx__host_ll *ll; /* low-latency mode (host_ll.h); NULL when off */
} epx__host_buffer_t;

/* Offsets for a config; EPX_ERR_INVALID_ARG if the sizes overflow. */
epx_status_t epx__host_layout(int world_size, const epx_buffer_config_t *config,
                              epx__host_layout_t *layout);

/* Address of the array at `offset` in `rank`'s data area. */
/* The low-latency state of a host buffer (NULL when the mode is off). */
static inline struct epx__host_ll *epx__host_ll_of(epx_buffer_t buffer)
{
    return ((epx__host_buffer_t *)buffer->impl)->ll;
}

static inline void *epx__host_region(const epx__host_buffer_t *host, int rank, size_t offset)
{
    return (char *)epx__shm_peer(host->shm, rank) + offset;
}

/*
 * Ranks and distinct experts of one token. For each topk entry e (-1 skipped):
 * rank_hit[e / num_local] = 1 and, the first time e appears in the row,
 * expert_counts[e]++ (expert_counts may be NULL). rank_hit must be zeroed by the caller.
 * EPX_ERR_INVALID_ARG naming the token and entry for an id outside [-1, num_experts).
 */
epx_status_t epx__host_route_token(const char *op, const int64_t *idx, int num_topk, int64_t token,
                                   int num_experts, int num_local, uint8_t *rank_hit,
                                   int32_t *expert_counts);

/* Write this rank's announcement for the call it is entering (before the first barrier). */
void epx__host_announce(epx__host_buffer_t *host, int rank, epx__host_op_t op, int cached,
                        epx_dtype_t x_dtype, int has_idx, int has_weights);

/* Compare every peer's call announcement with this rank's (after the first barrier). */
epx_status_t epx__host_check_calls(const epx__host_buffer_t *host, int rank, int world_size,
                                   const char *op);

epx_status_t epx__host_layout_op(epx_buffer_t buffer, const epx_layout_args_t *args, void *stream);
epx_status_t epx__host_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                epx_dispatch_result_t *result, void *stream);
epx_status_t epx__host_combine(epx_buffer_t buffer, const epx_combine_args_t *args, void *stream);
/* The staging x rows of this rank: combine reads an x that is exactly this view in place. */
epx_status_t epx__host_combine_input(epx_buffer_t buffer, void **base, int64_t *rows);
/* epx_fanout_copy (host_fanout.c). */
epx_status_t epx__host_fanout_copy(epx_buffer_t buffer, const epx_fanout_args_t *args,
                                   void *stream);
/* epx_fanin_reduce (host_fanin.c). */
epx_status_t epx__host_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args,
                                    void *stream);

#endif /* EPX_OPS_HOST_HOST_H */
