/*
 * The first step of every dispatch, shared by the single-node count exchange
 * (layout.cu) and the internode one (nvshmem/xn_notify.cu): each token's destination
 * ranks from its top-k ids (or the caller's is_token_in_rank bits), and its ordinal among
 * this rank's tokens to each one.
 */
#ifndef EPX_OPS_CUDA_NOTIFY_CUH
#define EPX_OPS_CUDA_NOTIFY_CUH

#include "signal.cuh"

/* Destination rank bit mask of one token; bad ids are recorded and skipped. */
__device__ __forceinline__ uint64_t epx_token_mask(const epx__cuda_shape_t &s,
                                                   const int64_t *row, int64_t token,
                                                   int32_t *expert_counts, int stage, int *bad)
{
    uint64_t mask = 0;
    for (int k = 0; k < s.num_topk; k++) {
        int64_t e = row[k];
        if (e == -1)
            continue;
        if (e < -1 || e >= s.num_experts) {
            epx_record_failure(s, EPX_CUDA_FAIL_EXPERT_ID, stage, s.rank, s.rank, e,
                               token * s.num_topk + k, 0);
            *bad = 1;
            continue;
        }
        /* An expert named twice in a token's row counts once (include/epx.h). */
        bool repeated = false;
        for (int earlier = 0; earlier < k; earlier++)
            repeated = repeated || row[earlier] == e;
        if (!repeated)
            atomicAdd(&expert_counts[e], 1);
        mask |= 1ull << (e / s.num_local_experts);
    }
    return mask;
}

/*
 * One round of the block-wide scan (blockDim.x tokens): `mask` has bit w set when this
 * thread's token goes to destination w (w < width <= 64). Writes, for each set bit, the
 * token's ordinal among all tokens so far with that bit to out[w] (-1 for clear bits,
 * out may be NULL past the last token), and carries the totals in running[width].
 * warp_totals is shared [32][EPX_CUDA_MAX_RANKS]. Every thread of the block calls it.
 */
__device__ __forceinline__ void epx_scan_round(uint64_t mask, int width, int32_t *out,
                                               int32_t *warp_totals, int32_t *running)
{
    const int lane = epx_lane(), warp = epx_warp();
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int w = 0; w < width; w++) {
        unsigned ballot = __ballot_sync(0xffffffffu, (mask >> w) & 1u);
        if (lane == 0)
            warp_totals[warp * EPX_CUDA_MAX_RANKS + w] = __popc(ballot);
    }
    __syncthreads();
    /* Turn per-warp totals into each warp's first ordinal, carrying the running count. */
    for (int w = threadIdx.x; w < width; w += blockDim.x) {
        int32_t acc = running[w];
        for (int v = 0; v < (int)(blockDim.x >> 5); v++) {
            int32_t total = warp_totals[v * EPX_CUDA_MAX_RANKS + w];
            warp_totals[v * EPX_CUDA_MAX_RANKS + w] = acc;
            acc += total;
        }
        running[w] = acc;
    }
    __syncthreads();
    for (int w = 0; w < width; w++) {
        unsigned ballot = __ballot_sync(0xffffffffu, (mask >> w) & 1u);
        if (out != NULL) {
            int32_t ordinal = warp_totals[warp * EPX_CUDA_MAX_RANKS + w] +
                              __popc(ballot & lanes_below);
            out[w] = ((mask >> w) & 1u) ? ordinal : -1;
        }
    }
    __syncthreads();
}

/* Step 1 of the notify kernel: ordinals into send_row, counts into shared memory. */
static __device__ void epx_notify_scan(const epx__cuda_shape_t &s, const epx__cuda_notify_args_t &a,
                                int32_t *expert_counts, int32_t *warp_totals,
                                int32_t *running, int *bad)
{
    const int R = s.world_size;
    for (int64_t first = 0; first < a.num_tokens; first += blockDim.x) {
        int64_t t = first + threadIdx.x;
        uint64_t mask = 0;
        if (t < a.num_tokens && a.topk_idx != NULL) {
            mask = epx_token_mask(s, a.topk_idx + t * a.topk_stride, t, expert_counts,
                                  EPX_CUDA_STAGE_NOTIFY, bad);
        } else if (t < a.num_tokens) {
            /* Routed by the layout: the caller's bits (the counts were loaded before). */
            const uint8_t *bits = a.is_token_in_rank + t * a.in_rank_stride;
            for (int r = 0; r < R; r++)
                mask |= (uint64_t)(bits[r] != 0) << r;
        }
        epx_scan_round(mask, R, t < a.num_tokens ? a.send_row + t * R : NULL, warp_totals,
                       running);
    }
}

#endif /* EPX_OPS_CUDA_NOTIFY_CUH */
