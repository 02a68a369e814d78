/*
 * Dispatch data kernel: every token row goes straight from the sender's x into each
 * destination rank's receive region. One copy per byte, no staging.
 *
 * What moves: for each token and each rank hosting one of its experts, the x row (bf16,
 * or fp8 + its fp32 scales), the top-k ids rewritten for that rank (local id or -1),
 * the weights (0 where the id is -1). The row lands at
 *     receiver row = (tokens of lower source ranks sent to the receiver) + ordinal,
 * so rows arrive ordered by source rank then source token with no receiver-side work.
 * The count exchange (layout.cu) computed both terms; in fresh mode this kernel adds
 * them and leaves the final rows in the handle's send_row for combine and cached mode.
 *
 * Roles: every warp of every block is a sender: one token at a time (its first by index,
 * the next by ticket as it frees up, epx_ticket_take: tokens go to 1-8 ranks, and a fixed
 * stride left the slowest warp several tokens behind; up to 5% faster measured), it
 * loads a chunk of the row once (kUnroll 16-byte vectors per lane, all in flight) and
 * stores it to each destination, so x is read once however many ranks receive it. With
 * few blocks (EPX_DISPATCH_PIPELINED_MAX_BLOCKS) the next chunk's loads are issued
 * before the current chunk's stores, so each warp keeps loads in flight while it stores.
 * A token's first chunk, its top-k entries and its scales are loaded before its routing
 * (send_row) is read, so one memory latency covers them all. Lanes 0..K-1 then write the
 * top-k entries for each destination.
 *
 * Signals: the last block to finish (grid counter) stores the sequence number into
 * every receiver's data flag (release, system scope) and waits until every source has
 * done the same here, so work later on the stream sees all received rows. The other
 * blocks exit at once, so at most one block per rank spins.
 *
 * This is the vector form (EPX_NORMAL_KERNELS=1, and the fallback of the bulk-copy form
 * in dispatch_bulk.cu and the staged form in dispatch_staged.cu for rows they cannot
 * take).
 *
 * Buffer use: rows [0, received) of the receive region, bounded by max_tokens_per_rank
 * * world_size. A sender writes into a receiver only after the receiver's count flag
 * for this operation arrived (stream order after the notify kernel), so the receiver
 * has left its previous operation and no longer reads its old results.
 */
#include "signal.cuh"

#define EPX_DISPATCH_WARPS (EPX_CUDA_THREADS / 32)
/* Up to this many blocks a rank, the pipelined kernel (see the launch). */
#define EPX_DISPATCH_PIPELINED_MAX_BLOCKS 8

/* Stores one loaded chunk of a token's row (kUnroll vectors a lane from i0) to each of
 * the warp's n destinations. */
template <int kUnroll>
__device__ __forceinline__ void epx_dispatch_store(const epx__cuda_shape_t &s,
                                                   const epx__cuda_dispatch_args_t &a,
                                                   char *const *peers, const int32_t *rank,
                                                   const int32_t *row, int n,
                                                   const int4 (&v)[kUnroll], int64_t i0,
                                                   int64_t units, int lane)
{
    for (int j = 0; j < n; j++) {
        char *dst = peers[rank[j]] + s.off_x + (int64_t)row[j] * a.recv_pitch;
        epx_st16_batch<kUnroll>(dst, v, i0, units, lane);
    }
}

/* What a token needs before its routing is read, loaded at once so that one memory
 * latency covers it all: its row's first chunk and its small parts (lane k: top-k entry
 * k and its weight; scales lane and lane + 32), which are written after the row. */
template <int kUnroll>
struct epx_dispatch_head_t {
    int4 v[kUnroll];
    int64_t id;
    float weight, scale0, scale1;
};

template <int kUnroll>
__device__ __forceinline__ void epx_dispatch_load_head(const epx__cuda_dispatch_args_t &a,
                                                       int64_t t, int64_t units, int lane,
                                                       int K, epx_dispatch_head_t<kUnroll> &h)
{
    const char *src = static_cast<const char *>(a.x) + t * a.x_stride;
    epx_ld16_batch<kUnroll>(h.v, src, 0, units, lane, a.x_align);
    h.id = -1;
    h.weight = h.scale0 = h.scale1 = 0.0f;
    if (a.topk_idx != NULL && lane < K) {
        h.id = a.topk_idx[t * a.topk_stride + lane];
        if (a.topk_weights != NULL)
            h.weight = a.topk_weights[t * a.weights_stride + lane];
    }
    if (lane < a.num_scales)
        h.scale0 = a.scales[t * a.scales_stride + lane * a.scales_col_stride];
    if (lane + 32 < a.num_scales)
        h.scale1 = a.scales[t * a.scales_stride + (lane + 32) * a.scales_col_stride];
}

/* Token t's destinations, in rank order, compacted into the warp's lists; their count.
 * Fresh: the ordinals in send_row become rows (the rank's base added) in place. */
__device__ __forceinline__ int epx_dispatch_route(const epx__cuda_dispatch_args_t &a,
                                                  const int32_t *bases, int R, int64_t t,
                                                  int lane, int32_t *dest_rank,
                                                  int32_t *dest_row)
{
    const unsigned lanes_below = (1u << lane) - 1u;
    int n = 0;
    for (int r0 = 0; r0 < R; r0 += 32) {
        int r = r0 + lane;
        int32_t row = -1;
        if (r < R) {
            row = a.send_row[t * R + r];
            if (a.fresh && row >= 0) {
                row += bases[r];
                a.send_row[t * R + r] = row;
            }
        }
        unsigned ballot = __ballot_sync(0xffffffffu, row >= 0);
        if (row >= 0) {
            int pos = n + __popc(ballot & lanes_below);
            dest_rank[pos] = r;
            dest_row[pos] = row;
        }
        n += __popc(ballot);
    }
    __syncwarp();
    return n;
}

/* Token t's scales and top-k entries (rewritten for each destination: local id or -1,
 * weight or 0) to its n destinations, after its row. */
template <int kUnroll>
__device__ __forceinline__ void epx_dispatch_tail(const epx__cuda_shape_t &s,
                                                  const epx__cuda_dispatch_args_t &a,
                                                  char *const *peers, const int32_t *dest_rank,
                                                  const int32_t *dest_row, int n, int64_t t,
                                                  const epx_dispatch_head_t<kUnroll> &h,
                                                  int lane)
{
    const int K = s.num_topk, L = s.num_local_experts;
    for (int i = lane; i < a.num_scales; i += 32) {
        float scale = i < 32   ? h.scale0
                      : i < 64 ? h.scale1
                               : a.scales[t * a.scales_stride + i * a.scales_col_stride];
        for (int j = 0; j < n; j++) {
            float *dst = reinterpret_cast<float *>(peers[dest_rank[j]] + s.off_scales);
            dst[(int64_t)dest_row[j] * a.num_scales + i] = scale;
        }
    }
    if (a.topk_idx == NULL)
        return;
    for (int k = lane; k < K; k += 32) {
        /* Entries 0..31 came with the head (lane k: entry k). */
        int64_t e = h.id;
        float w = h.weight;
        if (k != lane) {
            e = a.topk_idx[t * a.topk_stride + k];
            w = a.topk_weights != NULL ? a.topk_weights[t * a.weights_stride + k] : 0.0f;
        }
        /* Ids out of range were refused by the count exchange before this kernel. */
        int home = e >= 0 ? (int)(e / L) : -1;
        for (int j = 0; j < n; j++) {
            int r = dest_rank[j];
            int64_t row = dest_row[j];
            int here = home == r;
            int64_t *ids = reinterpret_cast<int64_t *>(peers[r] + s.off_topk_idx);
            ids[row * K + k] = here ? e - (int64_t)r * L : -1;
            if (a.topk_weights != NULL) {
                float *ws = reinterpret_cast<float *>(peers[r] + s.off_topk_weights);
                ws[row * K + k] = here ? w : 0.0f;
            }
        }
    }
}

/* kPipelined: the next chunk's loads are issued before the current chunk is stored. */
template <int kUnroll, int kPipelined>
__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_dispatch_kernel(epx__cuda_shape_t s, epx__cuda_dispatch_args_t a)
{
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t bases[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t dest_rank[EPX_DISPATCH_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int32_t dest_row[EPX_DISPATCH_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    /* Launched early (epx_launch_early): the count exchange's results first. */
    epx_wait_previous();
    const int R = s.world_size, K = s.num_topk;
    const uint64_t seq = epx_op_seq(s);
    if (!epx_dispatch_enter(s, peers, bases))
        return;
    __syncthreads();

    const int lane = epx_lane(), warp = epx_warp();
    const int64_t units = a.row_bytes / 16;
    const int64_t num_warps = (int64_t)gridDim.x * EPX_DISPATCH_WARPS;
    int32_t *const rank = dest_rank[warp], *const row = dest_row[warp];
    uint32_t *tickets = &s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH_TOKENS];

    int64_t t = (int64_t)blockIdx.x * EPX_DISPATCH_WARPS + warp;
    epx_dispatch_head_t<kUnroll> h;
    uint32_t ticket = 0;
    for (; t < a.num_tokens; t = epx_ticket_token(ticket, num_warps)) {
        ticket = epx_ticket_take(tickets, lane);
        const char *src = static_cast<const char *>(a.x) + t * a.x_stride;
        epx_dispatch_load_head<kUnroll>(a, t, units, lane, K, h);
        const int n = epx_dispatch_route(a, bases, R, t, lane, rank, row);
        if (n == 0)
            continue;
        for (int64_t i0 = 0; i0 < units; i0 += 32 * kUnroll) {
            if (kPipelined) {
                int4 next[kUnroll];
                if (i0 + 32 * kUnroll < units)
                    epx_ld16_batch<kUnroll>(next, src, i0 + 32 * kUnroll, units, lane,
                                            a.x_align);
                epx_dispatch_store<kUnroll>(s, a, peers, rank, row, n, h.v, i0, units, lane);
#pragma unroll
                for (int u = 0; u < kUnroll; u++)
                    h.v[u] = next[u];
            } else {
                if (i0 > 0)
                    epx_ld16_batch<kUnroll>(h.v, src, i0, units, lane, a.x_align);
                epx_dispatch_store<kUnroll>(s, a, peers, rank, row, n, h.v, i0, units, lane);
            }
        }
        epx_dispatch_tail<kUnroll>(s, a, peers, rank, row, n, t, h, lane);
        __syncwarp();
    }

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH], &last))
        return;
    epx_finish_exchange(s, offsetof(epx__cuda_slot_t, data_flag), seq, EPX_CUDA_STAGE_DISPATCH);
}

extern "C" cudaError_t epx__cuda_launch_dispatch(const epx__cuda_shape_t *shape,
                                                 const epx__cuda_dispatch_args_t *args,
                                                 cudaStream_t stream)
{
    if (args->kernels == EPX_CUDA_KERNELS_BULK || args->kernels == EPX_CUDA_KERNELS_STAGED) {
        int launched = 0;
        cudaError_t err = args->kernels == EPX_CUDA_KERNELS_BULK
                              ? epx__cuda_launch_dispatch_bulk(shape, args, stream, &launched)
                              : epx__cuda_launch_dispatch_staged(shape, args, stream, &launched);
        if (err != cudaSuccess || launched)
            return err;
    }
    /* Measured on an H200, 8 ranks, standard case (docs/PERFORMANCE.md, 2026-12-04): at 8
     * blocks a rank the pipelined form (4 vectors a lane, the next chunk's loads in flight
     * during the stores) is 15% faster for bf16 and 1-8% for fp8; at 16 the unpipelined
     * 8-deep form is as fast (bf16) or a few percent faster (fp8). */
    return epx_launch_early(args->num_blocks <= EPX_DISPATCH_PIPELINED_MAX_BLOCKS
                                ? epx_dispatch_kernel<4, 1>
                                : epx_dispatch_kernel<8, 0>,
                            dim3(args->num_blocks), dim3(EPX_CUDA_THREADS), 0, stream, *shape,
                            *args);
}
