/*
 * The small parts of a dispatched token, shared by the ring kernels (dispatch_bulk.cu,
 * dispatch_staged.cu): its top-k entries rewritten for each destination (local expert
 * id, or -1 and weight 0 where the expert lives elsewhere) and, when they do not travel
 * with the row, its fp8 scales; and the plan of their ring slots (launchers). What lands
 * where is dispatch.cu's (read its comment).
 */
#ifndef EPX_OPS_CUDA_DISPATCH_PARTS_CUH
#define EPX_OPS_CUDA_DISPATCH_PARTS_CUH

#include "bulk.cuh"
#include "launch.h"

/* Top-k id and weight `lane` of token t (-1 and 0 past K, or without top-k outputs). */
__device__ __forceinline__ void epx_load_topk(const epx__cuda_dispatch_args_t &a, int K,
                                              int64_t t, int lane, int64_t *id, float *weight)
{
    *id = -1;
    *weight = 0.0f;
    if (a.topk_idx != NULL && lane < K) {
        *id = a.topk_idx[t * a.topk_stride + lane];
        if (a.topk_weights != NULL)
            *weight = a.topk_weights[t * a.weights_stride + lane];
    }
}

/*
 * Whole warp: token t's scales (when `scales` is set: they did not travel with the row)
 * and top-k entries (when `topk` is set) to every rank r in `mask`, at row rows[r] there.
 * lane_id and lane_weight: entry `lane` as epx_load_topk read it (entries past 32 are
 * read here).
 */
__device__ __forceinline__ void epx_dispatch_store_parts(const epx__cuda_shape_t &s,
                                                         const epx__cuda_dispatch_args_t &a,
                                                         char *const *peers, uint64_t mask,
                                                         const int32_t *rows, int64_t t,
                                                         int scales, int topk, int64_t lane_id,
                                                         float lane_weight, int lane)
{
    const int L = s.num_local_experts, K = s.num_topk;
    if (scales) {
        for (int i = lane; i < a.num_scales; i += 32) {
            const float scale = a.scales[t * a.scales_stride + i * a.scales_col_stride];
            for (uint64_t m = mask; m != 0; m &= m - 1) {
                const int r = __ffsll(static_cast<long long>(m)) - 1;
                float *dst = reinterpret_cast<float *>(peers[r] + s.off_scales);
                dst[static_cast<int64_t>(rows[r]) * a.num_scales + i] = scale;
            }
        }
    }
    if (!topk || a.topk_idx == NULL)
        return;
    for (int k = lane; k < K; k += 32) {
        const int64_t e = k == lane ? lane_id : a.topk_idx[t * a.topk_stride + k];
        const float w = k == lane                  ? lane_weight
                        : a.topk_weights != NULL ? a.topk_weights[t * a.weights_stride + k]
                                                 : 0.0f;
        /* Ids out of range (past EPX_CUDA_MAX_EXPERTS too) were refused by the count
         * exchange before this kernel, so 32 bits divide them. */
        const int home = e >= 0 ? static_cast<int>(e) / L : -1;
        for (uint64_t m = mask; m != 0; m &= m - 1) {
            const int r = __ffsll(static_cast<long long>(m)) - 1;
            const int64_t at = rows[r];
            const int here = home == r;
            int64_t *ids = reinterpret_cast<int64_t *>(peers[r] + s.off_topk_idx);
            ids[at * K + k] = here ? e - static_cast<int64_t>(r) * L : -1;
            if (a.topk_weights != NULL) {
                float *ws = reinterpret_cast<float *>(peers[r] + s.off_topk_weights);
                ws[at * K + k] = here ? w : 0.0f;
            }
        }
    }
}

/* ---------------------------------------------------------------- launchers */

/* A ring dispatch's slots, as its launcher plans them and its kernel reads them. */
typedef struct {
    int stages;
    int bulk_scales;     /* fp8 scales contiguous and aligned: they travel with the row */
    int64_t scale_bytes; /* num_scales * 4 */
    int64_t slot_bytes;  /* row (+ scales), rounded up to 128 */
    int64_t route_bytes; /* bulk form: one slot's routing (destination mask, then a row
                          * per rank); 0 in the staged form, whose routing is static */
} epx_dispatch_ring_t;

/*
 * The slots of a ring dispatch for these arguments (stages and route_bytes left 0 for the
 * launcher); 0 when the case does not fit a ring: the kernels bulk-copy rows, so x rows,
 * the receive pitch and region must be 16-byte aligned.
 */
static inline int epx_dispatch_ring_plan(const epx__cuda_shape_t *shape,
                                         const epx__cuda_dispatch_args_t *a,
                                         epx_dispatch_ring_t *g)
{
    *g = epx_dispatch_ring_t{};
    if (a->x_align < 16 || a->row_bytes % 16 != 0 || a->recv_pitch % 16 != 0 ||
        shape->off_x % 16 != 0)
        return 0;
    g->scale_bytes = static_cast<int64_t>(a->num_scales) * 4;
    g->bulk_scales = a->num_scales > 0 && a->scales_col_stride == 1 && g->scale_bytes % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(a->scales) % 16 == 0 &&
                     (a->scales_stride * 4) % 16 == 0 && shape->off_scales >= 0 &&
                     shape->off_scales % 16 == 0;
    g->slot_bytes = epx_bulk_round_up(a->row_bytes + (g->bulk_scales ? g->scale_bytes : 0), 128);
    return 1;
}

#endif /* EPX_OPS_CUDA_DISPATCH_PARTS_CUH */
