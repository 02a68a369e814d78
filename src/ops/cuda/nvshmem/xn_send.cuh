/*
 * The per-token and per-record steps of the internode dispatch, shared by its two
 * kernels (xn_dispatch.cu: worst-case slots; xn_ring_dispatch.cu: rings with credits).
 * Each step is run by one warp; the destination lists live in the caller's shared
 * memory (one row of EPX_CUDA_MAX_RANKS entries per warp).
 *
 * A token's destinations are, in this fixed order, the ranks of this node that receive
 * it (dest >= 0: the rank; dest_row: its row there; dest_x: that row's address) and one
 * record per other node it goes to (dest = -1 - node; dest_row: the record's index among
 * this rank's records for that node; dest_x: its staging slot in the outbox).
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_XN_SEND_CUH
#define EPX_OPS_CUDA_NVSHMEM_XN_SEND_CUH

#include "ops/cuda/nvshmem/xn_device.cuh"

/* Fresh dispatch: token t's ordinals at every rank become its rows there (+ base). */
__device__ __forceinline__ void epx_xn_token_rows(const epx__cuda_dispatch_args_t &a, int64_t t,
                                                  int R, const int32_t *bases)
{
    if (!a.fresh)
        return;
    for (int r = epx_lane(); r < R; r += 32) {
        int32_t row = a.send_row[t * R + r];
        if (row >= 0)
            a.send_row[t * R + r] = row + bases[r];
    }
}

/*
 * Token t's destinations (see the top of this file); returns how many (every lane).
 * Record j for node n is staged at outbox slot n * slots + j, or, with a ring
 * (kRing: slots = the ring, a power of two), n * slots + j % slots.
 */
template <bool kRing>
__device__ __forceinline__ int epx_xn_token_dests(const epx__cuda_shape_t &s,
                                                  const epx__cuda_dispatch_args_t &a, int64_t t,
                                                  char *const *peers, char *outbox,
                                                  int64_t slots, int64_t record_bytes,
                                                  int32_t *dest, int32_t *dest_row,
                                                  char **dest_x)
{
    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node;
    const int lane = epx_lane();
    const unsigned lanes_below = (1u << lane) - 1u;
    const int first_local = epx_xn_node(s, s.rank) * P;
    int n = 0;
    {
        int r = first_local + lane;
        int32_t row = lane < P ? a.send_row[t * R + r] : -1;
        unsigned ballot = __ballot_sync(0xffffffffu, row >= 0);
        if (row >= 0) {
            int pos = __popc(ballot & lanes_below);
            dest[pos] = r;
            dest_row[pos] = row;
            dest_x[pos] = peers[r] + s.off_x + (int64_t)row * a.recv_pitch;
        }
        n = __popc(ballot);
    }
    for (int n0 = 0; n0 < N; n0 += 32) {
        int node = n0 + lane;
        int32_t pos = node < N ? a.xn.node_pos[t * N + node] : -1;
        unsigned ballot = __ballot_sync(0xffffffffu, pos >= 0);
        if (pos >= 0) {
            int at = n + __popc(ballot & lanes_below);
            int64_t slot = kRing ? (pos & (slots - 1)) : pos;
            dest[at] = -1 - node;
            dest_row[at] = pos;
            dest_x[at] = outbox + ((int64_t)node * slots + slot) * record_bytes;
        }
        n += __popc(ballot);
    }
    return n;
}

/*
 * Write token t to its n destinations: the x row (loaded once), fp8 scales, top-k ids
 * (rewritten to each rank's local experts; records keep the global ids) and weights,
 * and each record's rows at the ranks of its node. The caller syncs the warp after.
 */
template <int kUnroll>
__device__ __forceinline__ void epx_xn_token_write(const epx__cuda_shape_t &s,
                                                   const epx__cuda_dispatch_args_t &a,
                                                   const epx__cuda_xn_record_t &rec, int64_t t,
                                                   char *const *peers, const int32_t *dest,
                                                   const int32_t *dest_row, char *const *dest_x,
                                                   int n)
{
    const int R = s.world_size, P = s.ranks_per_node, L = s.num_local_experts, K = s.num_topk;
    const int lane = epx_lane();
    epx_xn_copy_row<kUnroll>(static_cast<const char *>(a.x) + t * a.x_stride, a.x_align, 0, dest_x,
                             n, a.row_bytes / 16);
    for (int i = lane; i < a.num_scales; i += 32) {
        float scale = a.scales[t * a.scales_stride + i * a.scales_col_stride];
        for (int j = 0; j < n; j++) {
            float *to = dest[j] >= 0 ? reinterpret_cast<float *>(peers[dest[j]] + s.off_scales) +
                                           (int64_t)dest_row[j] * a.num_scales
                                     : reinterpret_cast<float *>(dest_x[j] + rec.scales);
            to[i] = scale;
        }
    }
    if (a.topk_idx != NULL) {
        for (int k = lane; k < K; k += 32) {
            int64_t e = a.topk_idx[t * a.topk_stride + k];
            float w = a.topk_weights != NULL ? a.topk_weights[t * a.weights_stride + k] : 0.0f;
            int home = e >= 0 ? (int)(e / L) : -1;
            for (int j = 0; j < n; j++) {
                int r = dest[j];
                if (r < 0) {
                    /* A record keeps the global ids; its forwarder rewrites them. */
                    reinterpret_cast<int64_t *>(dest_x[j] + rec.topk_idx)[k] = e;
                    reinterpret_cast<float *>(dest_x[j] + rec.weights)[k] = w;
                    continue;
                }
                int64_t row = dest_row[j];
                int here = home == r;
                reinterpret_cast<int64_t *>(peers[r] + s.off_topk_idx)[row * K + k] =
                    here ? e - (int64_t)r * L : -1;
                if (a.topk_weights != NULL)
                    reinterpret_cast<float *>(peers[r] + s.off_topk_weights)[row * K + k] =
                        here ? w : 0.0f;
            }
        }
    }
    /* Each record's rows at the ranks of its node. */
    for (int j = 0; j < n; j++) {
        if (dest[j] >= 0)
            continue;
        int node = -1 - dest[j];
        for (int p = lane; p < P; p += 32)
            reinterpret_cast<int32_t *>(dest_x[j] + rec.rows)[p] =
                a.send_row[t * R + node * P + p];
    }
}

/*
 * Forward record j of node `node`, which has arrived at `record`, to the ranks of this
 * node that receive it (rows, scales, top-k ids rewritten per rank, weights); a fresh
 * dispatch keeps its rows in the handle for combine. The caller syncs the warp after.
 */
template <int kUnroll>
__device__ __forceinline__ void epx_xn_forward_record(const epx__cuda_shape_t &s,
                                                      const epx__cuda_dispatch_args_t &a,
                                                      const epx__cuda_xn_record_t &rec,
                                                      const char *record, int node, int64_t j,
                                                      char *const *peers, int32_t *dest,
                                                      int32_t *dest_row, char **dest_x)
{
    const int P = s.ranks_per_node, L = s.num_local_experts, K = s.num_topk;
    const int lane = epx_lane();
    const int first_local = epx_xn_node(s, s.rank) * P;
    const int32_t *rows = reinterpret_cast<const int32_t *>(record + rec.rows);
    int32_t row = lane < P ? __ldcg(rows + lane) : -1;
    if (a.fresh && lane < P)
        a.xn.fwd_rows[((int64_t)node * s.max_tokens + j) * P + lane] = row;
    unsigned ballot = __ballot_sync(0xffffffffu, row >= 0);
    if (row >= 0) {
        int pos = __popc(ballot & ((1u << lane) - 1u));
        int r = first_local + lane;
        dest[pos] = r;
        dest_row[pos] = row;
        dest_x[pos] = peers[r] + s.off_x + (int64_t)row * a.recv_pitch;
    }
    int n = __popc(ballot);
    __syncwarp();

    epx_xn_copy_row<kUnroll>(record, 16, 1, dest_x, n, a.row_bytes / 16);
    for (int i = lane; i < a.num_scales; i += 32) {
        float scale = __ldcg(reinterpret_cast<const float *>(record + rec.scales) + i);
        for (int d = 0; d < n; d++)
            reinterpret_cast<float *>(peers[dest[d]] + s.off_scales)
                [(int64_t)dest_row[d] * a.num_scales + i] = scale;
    }
    if (a.topk_idx != NULL) {
        for (int k = lane; k < K; k += 32) {
            int64_t e = __ldcg(reinterpret_cast<const long long *>(record + rec.topk_idx) + k);
            float w = __ldcg(reinterpret_cast<const float *>(record + rec.weights) + k);
            int home = e >= 0 ? (int)(e / L) : -1;
            for (int d = 0; d < n; d++) {
                int r = dest[d];
                int64_t at = (int64_t)dest_row[d] * K + k;
                int here = home == r;
                reinterpret_cast<int64_t *>(peers[r] + s.off_topk_idx)[at] =
                    here ? e - (int64_t)r * L : -1;
                if (a.topk_weights != NULL)
                    reinterpret_cast<float *>(peers[r] + s.off_topk_weights)[at] =
                        here ? w : 0.0f;
            }
        }
    }
}

#endif /* EPX_OPS_CUDA_NVSHMEM_XN_SEND_CUH */
