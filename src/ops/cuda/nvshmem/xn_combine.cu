/*
 * Internode combine: the reverse route of the internode dispatch, reduced inside each
 * node first, so one partial sum per (token, node) crosses the network.
 *
 * The order of additions (docs/INTERNODE.md; the CPU backend and the oracle use it too):
 *     partial[n] = bf16( sum over the ranks r of node n that received the token, in rank
 *                        order, of x_r[row] )            (fp32 accumulator from 0)
 *     out        = bf16( sum over nodes n in order of partial[n] )   (fp32 from 0)
 * With one node this is the single-node order exactly. Weights: fp32 partial sums per
 * node, added in node order, never rounded.
 *
 * 1. Ready (one block): publish where this rank's x is to the ranks of its node (as on
 *    one node), tell each partner on another node that this home rank entered the
 *    combine (an NVSHMEM signal: from then on the partner may put partial sums here),
 *    and wait until every rank of this node published its x.
 * 2. Reduce (the SM budget, a warp per item): the partial sum of this node for each of
 *    this rank's own tokens (kept here), and for each record forwarded in the dispatch
 *    (read from the ranks of this node in place), staged and put with a signal that
 *    adds one to a counter at the record's home rank.
 * 3. Finish (the SM budget, a warp per token): wait until each node's counter has all
 *    its partial sums, add the partials in node order, write out; the last block tells
 *    the ranks of this node it no longer reads their x, waits for theirs, and ends the
 *    operation.
 */
#include "ops/cuda/nvshmem/xn_device.cuh"

#define EPX_XN_COMBINE_UNROLL 2

__global__ void __launch_bounds__(64) epx_xn_ready_kernel(epx__cuda_shape_t s,
                                                          epx__cuda_combine_args_t a)
{
    const int P = s.ranks_per_node, N = s.num_nodes, me = s.rank, my_node = epx_xn_node(s, me);
    const int first = my_node * P;
    const uint64_t seq = epx_op_seq(s);
    if (epx_failed(s))
        return;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        epx__cuda_slot_t *slot = epx_slot(s, first + p, me);
        slot->ready_offset = a.x_offset;
        slot->ready_stride = a.x_stride;
        slot->ready_rows = a.x_rows;
        __threadfence_system();
        epx_st_release_sys(&slot->ready_flag, seq);
    }
    for (int node = threadIdx.x; node < N; node += blockDim.x)
        if (node != my_node)
            nvshmemx_signal_op(epx_xn_slot_field(s, me, offsetof(epx__cuda_slot_t, xn_enter)), seq,
                               NVSHMEM_SIGNAL_SET, epx_xn_partner(s, node));
    for (int p = threadIdx.x; p < P; p += blockDim.x)
        epx_wait_flag(s, &epx_slot(s, me, first + p)->ready_flag, seq,
                      EPX_CUDA_STAGE_COMBINE_READY, first + p);
}

/*
 * out_row = bf16(sum of the n source rows, in order), and when `weights` the K fp32
 * weights of each source summed into out_weights. The warp's lanes split the row.
 */
__device__ __forceinline__ void epx_xn_sum_rows(const char *const *src, const float *const *wsrc,
                                                int n, int64_t units, char *out_row, int out_align,
                                                float *out_weights, int K, int fresh_src)
{
    const int lane = epx_lane();
    const int kUnroll = EPX_XN_COMBINE_UNROLL;
    for (int64_t i0 = 0; i0 < units; i0 += 32 * kUnroll) {
        float acc[kUnroll][8];
#pragma unroll
        for (int u = 0; u < kUnroll; u++)
#pragma unroll
            for (int e = 0; e < 8; e++)
                acc[u][e] = 0.0f;
        for (int j = 0; j < n; j++) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                int64_t i = i0 + u * 32 + lane;
                if (i < units)
                    v[u] = fresh_src ? __ldcg(reinterpret_cast<const int4 *>(src[j]) + i)
                                     : epx_ld_nc_v4(src[j] + i * 16);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                const uint32_t *w = reinterpret_cast<const uint32_t *>(&v[u]);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[u][2 * e] += epx_bf16_lo(w[e]);
                    acc[u][2 * e + 1] += epx_bf16_hi(w[e]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            int64_t i = i0 + u * 32 + lane;
            if (i < units) {
                int4 packed;
                packed.x = (int)epx_pack_bf16(acc[u][0], acc[u][1]);
                packed.y = (int)epx_pack_bf16(acc[u][2], acc[u][3]);
                packed.z = (int)epx_pack_bf16(acc[u][4], acc[u][5]);
                packed.w = (int)epx_pack_bf16(acc[u][6], acc[u][7]);
                epx_st16(out_row + i * 16, packed, out_align);
            }
        }
    }
    if (out_weights != NULL)
        for (int k = lane; k < K; k += 32) {
            float sum = 0.0f;
            for (int j = 0; j < n; j++)
                sum += __ldcg(wsrc[j] + k);
            out_weights[k] = sum;
        }
}

__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_xn_reduce_kernel(epx__cuda_shape_t s, epx__cuda_combine_args_t a)
{
    __shared__ const char *x_base[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_stride[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_rows[EPX_CUDA_MAX_RANKS];
    __shared__ const char *src_row[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ const float *src_weights[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int32_t first_record[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int last;

    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node, K = s.num_topk;
    const int me = s.rank, my_node = epx_xn_node(s, me), first_local = my_node * P;
    const uint64_t seq = epx_op_seq(s);
    if (epx_failed(s))
        return;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const volatile epx__cuda_slot_t *slot = epx_slot(s, me, first_local + p);
        x_base[p] = epx_peer(s, first_local + p) + slot->ready_offset;
        x_stride[p] = slot->ready_stride;
        x_rows[p] = slot->ready_rows;
    }
    if (threadIdx.x == 0) {
        int32_t total = (int32_t)a.num_tokens;
        for (int node = 0; node < N; node++) {
            first_record[node] = total;
            total += a.xn.node_in[node];
        }
        first_record[N] = total;
    }
    __syncthreads();

    char *own = epx_xn_own(s);
    const int lane = epx_lane(), warp = epx_warp();
    const unsigned lanes_below = (1u << lane) - 1u;
    const int64_t units = s.hidden * 2 / 16;
    const int64_t partial_bytes = (s.hidden * 2 + (a.has_weights ? K * 4 : 0) + 15) / 16 * 16;
    const int64_t first_warp = (int64_t)blockIdx.x * EPX_XN_WARPS + warp;
    const int64_t num_warps = (int64_t)gridDim.x * EPX_XN_WARPS;
    uint64_t entered = 0; /* bit n: node n's home rank is known to have entered */
    int node = 0;

    for (int64_t step = first_warp; step < first_record[N]; step += num_warps) {
        /* Test mode takes the items last first. */
        const int64_t q = s.xn_test_delay_ns > 0 ? first_record[N] - 1 - step : step;
        /* Item q: this rank's own token q, or record q - first_record[node] of `node`. */
        const int32_t *rows;
        char *out;
        int is_record = q >= a.num_tokens;
        int64_t j = q;
        if (is_record) {
            node = 0; /* items may come in any order (test mode) */
            while (q >= first_record[node + 1])
                node++;
            j = q - first_record[node];
            rows = a.xn.fwd_rows + ((int64_t)node * s.max_tokens + j) * P;
            out = own + s.off_xn_partial_out + ((int64_t)node * s.max_tokens + j) *
                                                   s.xn_partial_pitch;
        } else {
            rows = a.send_row + q * R + first_local;
            out = own + s.off_xn_partial_in + ((int64_t)my_node * s.max_tokens + q) *
                                                  s.xn_partial_pitch;
        }
        int32_t row = lane < P ? rows[lane] : -1;
        if (row >= 0 && row >= x_rows[lane]) {
            epx_record_failure(s, EPX_CUDA_FAIL_ROWS, EPX_CUDA_STAGE_COMBINE_READY,
                               first_local + lane, me, row, x_rows[lane], 1);
            row = -1;
        }
        unsigned ballot = __ballot_sync(0xffffffffu, row >= 0);
        if (row >= 0) {
            int pos = __popc(ballot & lanes_below);
            src_row[warp][pos] = x_base[lane] + (int64_t)row * x_stride[lane];
            src_weights[warp][pos] =
                reinterpret_cast<const float *>(epx_peer(s, first_local + lane) +
                                                s.off_combine_weights) +
                (int64_t)row * K;
        }
        int n = __popc(ballot);
        __syncwarp();
        if (n == 0 && !is_record)
            continue; /* no rank of this node received the token: no partial */

        epx_xn_sum_rows(src_row[warp], src_weights[warp], n, units, out, 16,
                        a.has_weights ? reinterpret_cast<float *>(out + s.hidden * 2) : NULL, K,
                        0);
        __syncwarp();
        if (!is_record)
            continue;
        int home = epx_xn_partner(s, node);
        if (!((entered >> node) & 1u)) {
            int ok = 1;
            if (lane == 0)
                ok = epx_wait_flag(s, &epx_slot(s, me, home)->xn_enter, seq,
                                   EPX_CUDA_STAGE_COMBINE_ENTER, home);
            if (!__shfl_sync(0xffffffffu, ok, 0))
                break;
            entered |= 1ull << node;
        }
        epx_xn_test_delay(s.xn_test_delay_ns, (uint64_t)q);
        __syncwarp();
        char *slot = own + s.off_xn_partial_in +
                     ((int64_t)my_node * s.max_tokens + j) * s.xn_partial_pitch;
        nvshmemx_putmem_signal_nbi_warp(
            slot, out, (size_t)partial_bytes,
            epx_xn_slot_field(s, me, offsetof(epx__cuda_slot_t, xn_partials)), 1,
            NVSHMEM_SIGNAL_ADD, home);
        __syncwarp();
    }

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE], &last))
        return;
    if (threadIdx.x == 0)
        nvshmem_quiet();
}

__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_xn_finish_kernel(epx__cuda_shape_t s, epx__cuda_combine_args_t a)
{
    __shared__ const char *src_row[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ const float *src_weights[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node, K = s.num_topk;
    const int me = s.rank, my_node = epx_xn_node(s, me), first_local = my_node * P;
    const uint64_t seq = epx_op_seq(s);
    if (epx_failed(s))
        return;

    char *own = epx_xn_own(s);
    const int lane = epx_lane(), warp = epx_warp();
    const unsigned lanes_below = (1u << lane) - 1u;
    const int64_t units = s.hidden * 2 / 16;
    const int64_t first_warp = (int64_t)blockIdx.x * EPX_XN_WARPS + warp;
    const int64_t num_warps = (int64_t)gridDim.x * EPX_XN_WARPS;
    uint64_t arrived = 0; /* bit n: all of node n's partial sums are known to be here */
    int ok = 1;

    for (int64_t t = first_warp; ok && t < a.num_tokens; t += num_warps) {
        /* The partial sums of t, in node order: this node's if any rank here got t. */
        int here = 0;
        for (int p = lane; p < P; p += 32)
            here |= a.send_row[t * R + first_local + p] >= 0;
        here = __any_sync(0xffffffffu, here);
        int n = 0;
        for (int n0 = 0; n0 < N; n0 += 32) {
            int node = n0 + lane;
            int32_t pos = -1;
            if (node == my_node)
                pos = here ? (int32_t)t : -1;
            else if (node < N)
                pos = a.xn.node_pos[t * N + node];
            if (pos >= 0 && node != my_node && !((arrived >> node) & 1u)) {
                int partner = epx_xn_partner(s, node);
                uint64_t target =
                    s.local->xn_partials_seen[node] + (uint64_t)a.xn.node_out[node];
                if (!epx_wait_flag(s, &epx_slot(s, me, partner)->xn_partials, target,
                                   EPX_CUDA_STAGE_COMBINE_PARTIAL, partner))
                    ok = 0;
            }
            unsigned ballot = __ballot_sync(0xffffffffu, pos >= 0);
            if (pos >= 0) {
                int at = n + __popc(ballot & lanes_below);
                const char *slot = own + s.off_xn_partial_in +
                                   ((int64_t)node * s.max_tokens + pos) * s.xn_partial_pitch;
                src_row[warp][at] = slot;
                src_weights[warp][at] = reinterpret_cast<const float *>(slot + s.hidden * 2);
            }
            n += __popc(ballot);
            if (node < N && node != my_node && pos >= 0)
                arrived |= 1ull << node;
        }
        ok = __all_sync(0xffffffffu, ok);
        /* Every lane learns which nodes are known complete (lanes waited for theirs). */
        for (int o = 16; o > 0; o >>= 1)
            arrived |= __shfl_xor_sync(0xffffffffu, arrived, o);
        __syncwarp();
        if (!ok)
            break;
        epx_xn_sum_rows(src_row[warp], src_weights[warp], n, units,
                        static_cast<char *>(a.out_x) + t * a.out_stride, a.out_align,
                        a.has_weights ? a.out_weights + t * a.out_weights_stride : NULL, K, 1);
        __syncwarp();
    }

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_PARTIAL], &last))
        return;
    if (!epx_failed(s))
        for (int i = threadIdx.x; i < N; i += blockDim.x)
            s.local->xn_partials_seen[i] += (uint64_t)a.xn.node_out[i];
    __syncthreads();
    epx_xn_finish_node(s, offsetof(epx__cuda_slot_t, done_flag), seq,
                       EPX_CUDA_STAGE_COMBINE_DONE);
}

extern "C" int epx_xn_launch_combine(const epx__cuda_shape_t *shape,
                                     const epx__cuda_combine_args_t *args, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    epx_xn_ready_kernel<<<1, 64, 0, st>>>(*shape, *args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return (int)err;
    epx_xn_reduce_kernel<<<args->num_blocks, EPX_CUDA_THREADS, 0, st>>>(*shape, *args);
    if ((err = cudaGetLastError()) != cudaSuccess)
        return (int)err;
    epx_xn_finish_kernel<<<args->num_blocks, EPX_CUDA_THREADS, 0, st>>>(*shape, *args);
    return (int)cudaGetLastError();
}
