/*
 * Low-latency combine kernels (docs/LOW_LATENCY.md; src/ops/ref/host_ll_combine.c is
 * the oracle they match).
 *
 * Send (the warps of the grid share the received rows evenly): wait until
 * every unmasked home rank released this slot's previous combine; store each valid
 * row of x to its home rank's combine staging at [source token][top-k position] (a
 * direct store, or a put from the symmetric combine input); the last block raises the
 * combine flags.
 * Receive (a warp takes a token's top-k entries once, then chunks of 256 channels of
 * it): wait for the expert ranks' flags, out = bf16(sum over j of w_j * y_j) in fp32 with __fmul_rn / __fadd_rn in j
 * order (no fused multiply-add, like the host), entries on masked ranks skipped; the
 * last block releases the slot to the expert ranks.
 */
#include <cuda_bf16.h>

#include "ops/cuda/nvshmem/ll_device.cuh"

/* Expert rows a combine receive lane loads before it sums them. */
#define EPX_LL_BATCH 8

__global__ void __launch_bounds__(EPX_LL_THREADS)
    epx_ll_combine_send_kernel(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int32_t smem[];
    int32_t *ok = smem;                   /* [R] */
    int32_t *expert_first = smem + s.world; /* [L + 1] */
    __shared__ int last;
    const int R = s.world, k = s.topk, slot = op.slot, lane = threadIdx.x & 31,
              warp = threadIdx.x >> 5;
    const uint64_t seq = epx_ll_seq(s, slot, 1) + 1;
    epx_ll_wait_peers(s, EPX_LL_KIND_COMBINE_DONE, slot, seq - 1, EPX_LL_STAGE_COMBINE_RELEASE,
                      ok);

    const size_t slot_base = s.slot[slot], row_bytes = (size_t)s.hidden * 2;
    char *own = s.sym + slot_base;
    const char *in = s.local[slot];
    const char *x = reinterpret_cast<const char *>(op.x);
    const int in_place = x == own + s.combine_in;

    /* The warps of the grid share all received rows evenly. */
    const int L = s.num_local, warps = gridDim.x * EPX_LL_WARPS;
    const int32_t *recv_count = reinterpret_cast<const int32_t *>(in + s.recv_count);
    if (threadIdx.x == 0) {
        int32_t pos = 0;
        for (int e = 0; e < L; e++) {
            expert_first[e] = pos;
            pos += recv_count[e];
        }
        expert_first[L] = pos;
    }
    __syncthreads();
    for (int g = blockIdx.x * EPX_LL_WARPS + warp; g < expert_first[L]; g += warps) {
        {
            const int e = epx_ll_find(expert_first, L, g);
            const int i = g - expert_first[e];
            const int64_t row = (int64_t)e * s.rows + i;
            const int home_rank = reinterpret_cast<const int32_t *>(in + s.recv_src_rank)[row];
            if (!ok[home_rank])
                continue;
            const int64_t token = reinterpret_cast<const int32_t *>(in + s.recv_src_info)[row];
            const int64_t j = reinterpret_cast<const int32_t *>(in + s.recv_topk)[row];
            const size_t dst = slot_base + s.combine_stage + (size_t)(token * k + j) * row_bytes;
            const char *from = x + (size_t)row * row_bytes;
            char *home = s.peer[home_rank];
            if (home != NULL) {
                epx_ll_warp_copy(home + dst, from, row_bytes, lane);
            } else {
                /* Puts read symmetric memory: stage rows of a caller's tensor first. */
                char *staged = own + s.combine_in + (size_t)row * row_bytes;
                if (!in_place) {
                    epx_ll_warp_copy(staged, from, row_bytes, lane);
                    __syncwarp();
                }
                nvshmemx_putmem_nbi_warp(s.sym + dst, staged, row_bytes, home_rank);
            }
        }
    }

    if (!epx_ll_last_block(s, s.arrive + slot * 4 + EPX_LL_ARRIVE_COMBINE_SEND, &last))
        return;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (ok[r])
            epx_ll_signal(s, r, EPX_LL_KIND_COMBINE, slot, seq);
    if (threadIdx.x == 0)
        s.seq[slot * 2 + 1] = seq;
}

/*
 * Top-k entry j of a token for the reduction: the staging row to read (the first
 * position naming the same expert, where dispatch sent its one row) and the weight, or
 * -1 for -1 entries, entries on masked ranks and j >= k.
 */
__device__ __forceinline__ void epx_ll_entry(const int64_t *idx, const float *weights, int j,
                                             int k, int L, const int32_t *ok, int *first,
                                             float *weight)
{
    *first = -1;
    *weight = 0.0f;
    if (j >= k)
        return;
    const int64_t e = idx[j];
    if (e < 0 || !ok[e / L])
        return;
    int f = 0;
    while (idx[f] != e)
        f++;
    *first = f;
    *weight = weights[j];
}

__global__ void __launch_bounds__(EPX_LL_THREADS)
    epx_ll_combine_recv_kernel(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int32_t ok[]; /* [R] */
    __shared__ int last;
    const int R = s.world, k = s.topk, L = s.num_local, slot = op.slot, lane = threadIdx.x & 31;
    const uint64_t seq = epx_ll_seq(s, slot, 1);
    epx_ll_wait_peers(s, EPX_LL_KIND_COMBINE, slot, seq, EPX_LL_STAGE_COMBINE, ok);

    const char *stage = s.sym + s.slot[slot] + s.combine_stage;
    const int64_t chunks = (s.hidden + 255) / 256;
    const int64_t warps = (int64_t)gridDim.x * EPX_LL_WARPS;
    /* A warp takes one token and every parts-th chunk of it (all warps busy). */
    int64_t parts = op.tokens > 0 ? warps / op.tokens : 1;
    parts = parts < 1 ? 1 : (parts > chunks ? chunks : parts);
    for (int64_t item = (int64_t)blockIdx.x * EPX_LL_WARPS + (threadIdx.x >> 5);
         item < op.tokens * parts; item += warps) {
        const int64_t t = item / parts;
        const int64_t *idx = op.topk_idx + t * op.idx_stride;
        const float *weights = op.weights + t * op.weight_stride;
        /* Lane j's entry: the staging row it reads (the expert's first top-k position),
         * or -1 when it adds nothing, and its weight. Computed once when k <= 32. */
        int my_first = -1;
        float my_weight = 0.0f;
        if (k <= 32)
            epx_ll_entry(idx, weights, lane, k, L, ok, &my_first, &my_weight);
        /* Two chunks at a time: 2 x EPX_LL_BATCH rows in flight per lane. */
        for (int64_t c = item % parts; c < chunks; c += 2 * parts) {
            int64_t channel[2];
            channel[0] = c * 256 + (int64_t)lane * 8;
            channel[1] = (c + parts) * 256 + (int64_t)lane * 8;
            const int live1 = c + parts < chunks;
            float acc[2][8];
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 8; i++)
                    acc[h][i] = 0.0f;
            for (int j0 = 0; j0 < k; j0 += 32) {
                int first = my_first;
                float weight = my_weight;
                if (k > 32)
                    epx_ll_entry(idx, weights, j0 + lane, k, L, ok, &first, &weight);
                const int n = k - j0 < 32 ? k - j0 : 32;
                for (int b0 = 0; b0 < n; b0 += EPX_LL_BATCH) {
                    int4 raw[2][EPX_LL_BATCH];
                    float w[EPX_LL_BATCH];
                    int f[EPX_LL_BATCH];
#pragma unroll
                    for (int b = 0; b < EPX_LL_BATCH; b++) {
                        const int jj = b0 + b < n ? b0 + b : 0;
                        f[b] = __shfl_sync(0xffffffffu, first, jj);
                        w[b] = __shfl_sync(0xffffffffu, weight, jj);
                        if (b0 + b >= n)
                            f[b] = -1;
                        const char *row = stage + (size_t)(t * k + (f[b] < 0 ? 0 : f[b])) * s.hidden * 2;
                        raw[0][b] = raw[1][b] = make_int4(0, 0, 0, 0);
                        if (f[b] >= 0 && channel[0] < s.hidden)
                            raw[0][b] = epx_ld_nc_v4(row + channel[0] * 2);
                        if (f[b] >= 0 && live1 && channel[1] < s.hidden)
                            raw[1][b] = epx_ld_nc_v4(row + channel[1] * 2);
                    }
#pragma unroll
                    for (int b = 0; b < EPX_LL_BATCH; b++) {
                        if (f[b] < 0)
                            continue;
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const __nv_bfloat16 *y = reinterpret_cast<const __nv_bfloat16 *>(&raw[h][b]);
                            for (int i = 0; i < 8; i++)
                                acc[h][i] = __fadd_rn(acc[h][i], __fmul_rn(w[b], __bfloat162float(y[i])));
                        }
                    }
                }
            }
            for (int h = 0; h < 2; h++) {
                if (channel[h] >= s.hidden || (h == 1 && !live1))
                    continue;
                int4 packed;
                __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(&packed);
                for (int i = 0; i < 8; i++)
                    o[i] = __float2bfloat16_rn(acc[h][i]);
                epx_st_v4(reinterpret_cast<char *>(op.out) + ((size_t)t * op.out_stride + channel[h]) * 2,
                          packed);
            }
        }
    }

    if (!epx_ll_last_block(s, s.arrive + slot * 4 + EPX_LL_ARRIVE_COMBINE_RECV, &last))
        return;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (ok[r])
            epx_ll_signal(s, r, EPX_LL_KIND_COMBINE_DONE, slot, seq);
}

extern "C" int epx_ll_launch_combine_send(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                          void *stream)
{
    size_t smem = ((size_t)s->world + (size_t)s->num_local + 1) * sizeof(int32_t);
    epx_ll_combine_send_kernel<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op);
    return (int)cudaGetLastError();
}

extern "C" int epx_ll_launch_combine_recv(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                          void *stream)
{
    size_t smem = (size_t)s->world * sizeof(int32_t);
    epx_ll_combine_recv_kernel<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op);
    return (int)cudaGetLastError();
}
