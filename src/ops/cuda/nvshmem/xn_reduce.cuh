/*
 * The reductions of the internode combine, shared by its two kernels (xn_combine.cu:
 * worst-case slots; xn_ring_combine.cu: rings with credits): the loads and fp32 sums of
 * bf16 rows in a fixed order, this node's rows of an item, the partial sum of a record
 * this rank forwarded, and the final sum of an own token in node order (docs/INTERNODE.md
 * defines the order; the CPU backend and the oracle use it too).
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_XN_REDUCE_CUH
#define EPX_OPS_CUDA_NVSHMEM_XN_REDUCE_CUH

#include "ops/cuda/nvshmem/xn_device.cuh"
#include "ops/cuda/reduce.cuh"

#define EPX_XN_COMBINE_UNROLL 2

#define EPX_XN_COMBINE_GROUP 4

/*
 * acc += the n source rows, in order, for the vectors i0 + u * 32 + lane; kGroup sources
 * x kUnroll vectors of loads in flight per lane. `fresh` sources (written by a peer's
 * put during this kernel) are read through L2 only.
 */
__device__ __forceinline__ void epx_xn_accumulate(const char *const *src, int n, int64_t i0,
                                                  int64_t units, int fresh,
                                                  float (&acc)[EPX_XN_COMBINE_UNROLL][8])
{
    const int lane = epx_lane();
    const int kUnroll = EPX_XN_COMBINE_UNROLL, kGroup = EPX_XN_COMBINE_GROUP;
    for (int j0 = 0; j0 < n; j0 += kGroup) {
        int4 v[kGroup][kUnroll];
#pragma unroll
        for (int g = 0; g < kGroup; g++)
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                int64_t i = i0 + u * 32 + lane;
                if (j0 + g < n && i < units)
                    v[g][u] = fresh ? __ldcg(reinterpret_cast<const int4 *>(src[j0 + g]) + i)
                                    : epx_ld_nc_v4(src[j0 + g] + i * 16);
            }
#pragma unroll
        for (int g = 0; g < kGroup; g++) {
            if (j0 + g >= n)
                break;
#pragma unroll
            for (int u = 0; u < kUnroll; u++)
                epx_add_bf16x8(acc[u], v[g][u]);
        }
    }
}

/* sum += the K weights of each source, in order (lanes split K). */
__device__ __forceinline__ void epx_xn_add_weights(const float *const *src, int n, int K,
                                                   float *sum)
{
    for (int k = epx_lane(), i = 0; k < K; k += 32, i++)
        for (int j = 0; j < n; j++)
            sum[i] += __ldcg(src[j] + k);
}

/*
 * This node's rows of one item (rows[p] = its row at local rank p, or -1), in rank order:
 * their addresses in the peers' x and combine weights. Returns how many (every lane).
 */
__device__ __forceinline__ int epx_xn_local_sources(const epx__cuda_shape_t &s, const int32_t *rows,
                                                    const char *const *x_base,
                                                    const int64_t *x_stride,
                                                    const int64_t *x_rows, const char **row_out,
                                                    const float **weights_out)
{
    const int lane = epx_lane(), P = s.ranks_per_node;
    const int first_local = epx_xn_node(s, s.rank) * P;
    int32_t row = lane < P ? rows[lane] : -1;
    if (row >= 0 && row >= x_rows[lane]) {
        epx_record_failure(s, EPX_CUDA_FAIL_ROWS, EPX_CUDA_STAGE_COMBINE_READY, first_local + lane,
                           s.rank, row, x_rows[lane], 1);
        row = -1;
    }
    unsigned ballot = __ballot_sync(0xffffffffu, row >= 0);
    if (row >= 0) {
        int pos = __popc(ballot & ((1u << lane) - 1u));
        row_out[pos] = x_base[lane] + (int64_t)row * x_stride[lane];
        weights_out[pos] = reinterpret_cast<const float *>(epx_peer(s, first_local + lane) +
                                                           s.off_combine_weights) +
                           (int64_t)row * s.num_topk;
    }
    return __popc(ballot);
}

#define EPX_XN_MAX_K_PER_LANE 8 /* top-k up to 256 */

/*
 * The partial sum of one forwarded record over this node's n_local rows (rank order),
 * rounded to bf16, and, with weights, the fp32 sums of their weights: written to `out`
 * (a partial-sum slot: the bf16 row, then K fp32 weights).
 */
__device__ __forceinline__ void epx_xn_partial_write(const epx__cuda_shape_t &s,
                                                     const epx__cuda_combine_args_t &a, char *out,
                                                     const char *const *local_row,
                                                     const float *const *local_weights,
                                                     int n_local)
{
    const int64_t units = s.hidden * 2 / 16;
    const int K = s.num_topk;
    for (int64_t i0 = 0; i0 < units; i0 += 32 * EPX_XN_COMBINE_UNROLL) {
        float acc[EPX_XN_COMBINE_UNROLL][8] = {};
        epx_xn_accumulate(local_row, n_local, i0, units, 0, acc);
        epx_store_sums(out, 16, acc, i0, units, epx_lane());
    }
    if (a.has_weights) {
        float sum[EPX_XN_MAX_K_PER_LANE] = {};
        epx_xn_add_weights(local_weights, n_local, K, sum);
        for (int k = epx_lane(), i = 0; k < K; k += 32, i++)
            reinterpret_cast<float *>(out + s.hidden * 2)[k] = sum[i];
    }
}

/*
 * Own token j's result, in node order, after the caller's biases if any: the partial sums
 * of the nodes before this one
 * (remote_row[0, before)), this node's partial (its n_local rows summed in rank order,
 * rounded to bf16 as if it had crossed the network), then the nodes after it
 * (remote_row[before, n_remote)); written to out_x row j (and out_weights).
 */
__device__ __forceinline__ void epx_xn_reduce_token(const epx__cuda_shape_t &s,
                                                    const epx__cuda_combine_args_t &a, int64_t j,
                                                    const char *const *local_row,
                                                    const float *const *local_weights,
                                                    int n_local, const char *const *remote_row,
                                                    const float *const *remote_weights,
                                                    int before, int n_remote)
{
    const int64_t units = s.hidden * 2 / 16;
    const int K = s.num_topk;
    char *out = static_cast<char *>(a.out_x) + j * a.out_stride;
    for (int64_t i0 = 0; i0 < units; i0 += 32 * EPX_XN_COMBINE_UNROLL) {
        float total[EPX_XN_COMBINE_UNROLL][8];
        /* 0, or the caller's biases (bias_0 + bias_1: DeepEP's order, biases first). */
        epx_start_sums<EPX_XN_COMBINE_UNROLL>(total, a, j, 0, i0, units, epx_lane());
        epx_xn_accumulate(remote_row, before, i0, units, 1, total);
        if (n_local > 0) {
            float acc[EPX_XN_COMBINE_UNROLL][8] = {};
            epx_xn_accumulate(local_row, n_local, i0, units, 0, acc);
#pragma unroll
            for (int u = 0; u < EPX_XN_COMBINE_UNROLL; u++)
#pragma unroll
                for (int e = 0; e < 8; e++)
                    total[u][e] += epx_bf16_lo(epx_float_to_bf16(acc[u][e]));
        }
        epx_xn_accumulate(remote_row + before, n_remote - before, i0, units, 1, total);
        epx_store_sums(out, a.out_align, total, i0, units, epx_lane());
    }
    if (a.has_weights) {
        float total[EPX_XN_MAX_K_PER_LANE] = {};
        epx_xn_add_weights(remote_weights, before, K, total);
        if (n_local > 0) {
            float part[EPX_XN_MAX_K_PER_LANE] = {};
            epx_xn_add_weights(local_weights, n_local, K, part);
            for (int i = 0; i < EPX_XN_MAX_K_PER_LANE; i++)
                total[i] += part[i];
        }
        epx_xn_add_weights(remote_weights + before, n_remote - before, K, total);
        for (int k = epx_lane(), i = 0; k < K; k += 32, i++)
            a.out_weights[j * a.out_weights_stride + k] = total[i];
    }
}

/*
 * The start of both combine kernels: where each rank of this node published its x (its
 * ready-kernel slot: base, stride, rows), and where each node's records begin in the
 * forwarded-record order (first_record[N] = all of them). Ends with a block barrier.
 */
__device__ __forceinline__ void epx_xn_combine_sources(const epx__cuda_shape_t &s,
                                                       const epx__cuda_combine_args_t &a,
                                                       const char **x_base, int64_t *x_stride,
                                                       int64_t *x_rows, int32_t *first_record)
{
    const int P = s.ranks_per_node, me = s.rank, first_local = epx_xn_node(s, me) * P;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const volatile epx__cuda_slot_t *slot = epx_slot(s, me, first_local + p);
        x_base[p] = epx_peer_x(s, first_local + p, slot);
        x_stride[p] = slot->ready_stride;
        x_rows[p] = slot->ready_rows;
    }
    epx_xn_first_records(a.xn.node_in, s.num_nodes, first_record);
    __syncthreads();
}

#endif /* EPX_OPS_CUDA_NVSHMEM_XN_REDUCE_CUH */
