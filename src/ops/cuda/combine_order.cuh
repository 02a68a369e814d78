/*
 * The order of a token's rows in the normal-mode combine sums (combine.cu,
 * combine_bulk.cu): rank order, or with order_topk (epx_combine_args_t.order_topk_idx)
 * DeepEP V2's: a rank's row at the place of its last entry in the token's top-k row,
 * ranks named nowhere after those, in rank order. The CPU backend (host_combine.c) and
 * the oracle (tests/common/moe_case.c) add in the same order, so results are checked bit
 * for bit.
 */
#ifndef EPX_OPS_CUDA_COMBINE_ORDER_CUH
#define EPX_OPS_CUDA_COMBINE_ORDER_CUH

#include <stdint.h>

#include "launch.h"

/*
 * Whole warp, token t: the places in the sum of the lane's ranks lane and lane + 32, of
 * which has0 / has1 say whether their row is summed. *at0 / *at1 are set for those.
 * Returns how many rows are summed (the same on every lane).
 */
__device__ __forceinline__ int epx_combine_places(const epx__cuda_combine_args_t &a,
                                                   int num_topk, int num_local_experts,
                                                   int world_size, int64_t t, bool has0,
                                                   bool has1, int lane, int *at0, int *at1)
{
    const unsigned lanes_below = (1u << lane) - 1u;
    const unsigned low = __ballot_sync(0xffffffffu, has0);
    const unsigned high = __ballot_sync(0xffffffffu, has1);
    const int n = __popc(low) + __popc(high);
    if (a.order_topk == NULL) {
        *at0 = __popc(low & lanes_below);
        *at1 = __popc(low) + __popc(high & lanes_below);
        return n;
    }
    /* Each rank's key: its last entry's place, or num_topk + rank when named nowhere. */
    const int r0 = lane, r1 = lane + 32;
    int last0 = -1, last1 = -1;
    const int64_t *row = a.order_topk + t * a.order_stride;
    const int64_t experts = static_cast<int64_t>(world_size) * num_local_experts;
    for (int j0 = 0; j0 < num_topk; j0 += 32) {
        int rank = -1;
        if (j0 + lane < num_topk) {
            const int64_t id = row[j0 + lane];
            rank = id >= 0 && id < experts ? static_cast<int>(id / num_local_experts) : -1;
        }
        const int n = num_topk - j0 < 32 ? num_topk - j0 : 32;
        for (int j = 0; j < n; j++) {
            const int rj = __shfl_sync(0xffffffffu, rank, j);
            if (rj == r0)
                last0 = j0 + j;
            if (rj == r1)
                last1 = j0 + j;
        }
    }
    const int big = 0x7fffffff;
    const int key0 = has0 ? (last0 >= 0 ? last0 : num_topk + r0) : big;
    const int key1 = has1 ? (last1 >= 0 ? last1 : num_topk + r1) : big;
    /* A rank's place: the summed ranks with a smaller key (keys differ). */
    int place0 = 0, place1 = 0;
    for (int l = 0; l < 32; l++) {
        const int k0 = __shfl_sync(0xffffffffu, key0, l);
        const int k1 = __shfl_sync(0xffffffffu, key1, l);
        place0 += (k0 < key0) + (k1 < key0);
        place1 += (k0 < key1) + (k1 < key1);
    }
    *at0 = place0;
    *at1 = place1;
    return n;
}

#endif /* EPX_OPS_CUDA_COMBINE_ORDER_CUH */
