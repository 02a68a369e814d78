/*
 * The first step of every dispatch, shared by the single-node count exchange
 * (layout.cu) and the internode one (nvshmem/xn_notify.cu): each token's destination
 * ranks from its top-k ids (or the caller's is_token_in_rank bits), and its ordinal among
 * this rank's tokens to each one.
 */
#ifndef EPX_OPS_CUDA_NOTIFY_CUH
#define EPX_OPS_CUDA_NOTIFY_CUH

#include "signal.cuh"

/* A token's first EPX_MASK_IDS top-k ids are loaded at once (16-byte loads where the row
 * allows), so one memory latency covers them; ids past that are read one by one. */
#define EPX_MASK_IDS 8

/*
 * Destination rank bit mask of one token, its distinct experts counted in expert_counts
 * (unless NULL); bad ids are skipped and recorded as the failure, or, with first_bad,
 * only their lowest entry index kept there (atomicMin) for the caller to record later.
 */
__device__ __forceinline__ uint64_t epx_token_mask(const epx__cuda_shape_t &s,
                                                   const int64_t *row, int64_t token,
                                                   int32_t *expert_counts, int stage, int *bad,
                                                   unsigned long long *first_bad = NULL)
{
    const int K = s.num_topk;
    int64_t ids[EPX_MASK_IDS];
    if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
#pragma unroll
        for (int q = 0; q < EPX_MASK_IDS; q += 2) {
            if (q + 1 < K) {
                const longlong2 pair = *reinterpret_cast<const longlong2 *>(row + q);
                ids[q] = pair.x;
                ids[q + 1] = pair.y;
            } else {
                ids[q] = q < K ? row[q] : -1;
                ids[q + 1] = -1;
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < EPX_MASK_IDS; k++)
            ids[k] = k < K ? row[k] : -1;
    }

    uint64_t mask = 0;
    /* Entry k = e: counted once per token (an expert named twice in a token's row counts
     * once, include/epx.h); ids out of range are recorded and skipped. */
    auto add = [&](int k, int64_t e, bool repeated) {
        if (e == -1)
            return;
        if (e < -1 || e >= s.num_experts) {
            if (first_bad != NULL)
                atomicMin(first_bad, (unsigned long long)(token * K + k));
            else
                epx_record_failure(s, EPX_CUDA_FAIL_EXPERT_ID, stage, s.rank, s.rank, e,
                                   token * K + k, 0);
            *bad = 1;
            return;
        }
        if (!repeated && expert_counts != NULL)
            atomicAdd(&expert_counts[e], 1);
        mask |= 1ull << ((int)e / s.num_local_experts);
    };
#pragma unroll
    for (int k = 0; k < EPX_MASK_IDS; k++) {
        if (k >= K)
            break;
        bool repeated = false;
#pragma unroll
        for (int i = 0; i < k; i++)
            repeated = repeated || ids[i] == ids[k];
        add(k, ids[k], repeated);
    }
    for (int k = EPX_MASK_IDS; k < K; k++) {
        const int64_t e = row[k];
        bool repeated = false;
#pragma unroll
        for (int i = 0; i < EPX_MASK_IDS; i++)
            repeated = repeated || ids[i] == e;
        for (int earlier = EPX_MASK_IDS; earlier < k; earlier++)
            repeated = repeated || row[earlier] == e;
        add(k, e, repeated);
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
    const int lane = epx_lane(), warp = epx_warp(), warps = (int)(blockDim.x >> 5);
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int w = 0; w < width; w++) {
        unsigned ballot = __ballot_sync(0xffffffffu, (mask >> w) & 1u);
        if (lane == 0)
            warp_totals[warp * EPX_CUDA_MAX_RANKS + w] = __popc(ballot);
    }
    __syncthreads();
    /* Each warp's first ordinal, carrying the running count: warp 0 scans the per-warp
     * totals of one destination at a time, a lane per warp. */
    if (warp == 0) {
        for (int w = 0; w < width; w++) {
            const int32_t total = lane < warps ? warp_totals[lane * EPX_CUDA_MAX_RANKS + w] : 0;
            int32_t inclusive = total;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int32_t below = __shfl_up_sync(0xffffffffu, inclusive, d);
                if (lane >= d)
                    inclusive += below;
            }
            const int32_t base = running[w];
            if (lane < warps)
                warp_totals[lane * EPX_CUDA_MAX_RANKS + w] = base + inclusive - total;
            __syncwarp();
            if (lane == 31)
                running[w] = base + inclusive;
            __syncwarp();
        }
    }
    __syncthreads();
    /* The ordinals, four destinations a store where the row allows. */
    const bool vector = out != NULL && (width & 3) == 0 &&
                        (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
    for (int w0 = 0; w0 < width; w0 += 4) {
        int32_t ordinal[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int w = w0 + i;
            const unsigned bit = w < width ? (unsigned)((mask >> w) & 1u) : 0u;
            const unsigned ballot = __ballot_sync(0xffffffffu, bit);
            const int32_t first = warp_totals[warp * EPX_CUDA_MAX_RANKS + (w < width ? w : 0)];
            ordinal[i] = bit ? first + __popc(ballot & lanes_below) : -1;
        }
        if (vector) {
            *reinterpret_cast<int4 *>(out + w0) =
                make_int4(ordinal[0], ordinal[1], ordinal[2], ordinal[3]);
        } else if (out != NULL) {
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (w0 + i < width)
                    out[w0 + i] = ordinal[i];
        }
    }
    __syncthreads();
}

/* Token t's destination ranks in a fresh count exchange: from its top-k ids, or the
 * caller's is_token_in_rank bits (whose per-expert counts the caller gives). */
static __device__ __forceinline__ uint64_t epx_notify_mask(const epx__cuda_shape_t &s,
                                                           const epx__cuda_notify_args_t &a,
                                                           int64_t t, int32_t *expert_counts,
                                                           int *bad,
                                                           unsigned long long *first_bad = NULL)
{
    if (a.topk_idx != NULL)
        return epx_token_mask(s, a.topk_idx + t * a.topk_stride, t, expert_counts,
                              EPX_CUDA_STAGE_NOTIFY, bad, first_bad);
    const uint8_t *bits = a.is_token_in_rank + t * a.in_rank_stride;
    uint64_t mask = 0;
    for (int r = 0; r < s.world_size; r++)
        mask |= (uint64_t)(bits[r] != 0) << r;
    return mask;
}

/* Step 1 of the notify kernel in one block: ordinals into send_row, counts into shared
 * memory (the internode count exchange; layout.cu splits it over blocks instead). */
static __device__ void epx_notify_scan(const epx__cuda_shape_t &s, const epx__cuda_notify_args_t &a,
                                int32_t *expert_counts, int32_t *warp_totals,
                                int32_t *running, int *bad)
{
    const int R = s.world_size;
    for (int64_t first = 0; first < a.num_tokens; first += blockDim.x) {
        int64_t t = first + threadIdx.x;
        uint64_t mask = t < a.num_tokens ? epx_notify_mask(s, a, t, expert_counts, bad) : 0;
        epx_scan_round(mask, R, t < a.num_tokens ? a.send_row + t * R : NULL, warp_totals,
                       running);
    }
}

#endif /* EPX_OPS_CUDA_NOTIFY_CUH */
