/*
 * Low-latency combine kernels (docs/LOW_LATENCY.md; src/ops/ref/host_ll_combine.c is
 * the oracle they match).
 *
 * Send (the warps of the grid share the received rows evenly): wait until
 * every unmasked home rank released this slot's previous combine; store each valid
 * row of x to its home rank's combine staging at [source token][top-k position] (a
 * direct store, or a put from the symmetric combine input); the last block raises the
 * combine flags.
 * Receive (work item = (token, 256 channels) per warp): wait for the expert ranks'
 * flags, out = bf16(sum over j of w_j * y_j) in fp32 with __fmul_rn / __fadd_rn in j
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
    for (int64_t item = (int64_t)blockIdx.x * EPX_LL_WARPS + (threadIdx.x >> 5);
         item < op.tokens * chunks; item += warps) {
        const int64_t t = item / chunks;
        const int64_t channel = (item % chunks) * 256 + (int64_t)lane * 8;
        if (channel >= s.hidden)
            continue;
        const int64_t *idx = op.topk_idx + t * op.idx_stride;
        const float *weights = op.weights + t * op.weight_stride;
        float acc[8];
        for (int i = 0; i < 8; i++)
            acc[i] = 0.0f;
        /* Up to EPX_LL_BATCH rows in flight, then summed in j order. */
        for (int j0 = 0; j0 < k; j0 += EPX_LL_BATCH) {
            int4 raw[EPX_LL_BATCH];
            float w[EPX_LL_BATCH];
#pragma unroll
            for (int b = 0; b < EPX_LL_BATCH; b++) {
                const int j = j0 + b;
                w[b] = 0.0f;
                raw[b] = make_int4(0, 0, 0, 0);
                if (j >= k)
                    continue;
                const int64_t e = idx[j];
                if (e < 0 || !ok[e / L])
                    continue;
                int first = 0;
                while (idx[first] != e)
                    first++;
                w[b] = weights[j];
                raw[b] = epx_ld_nc_v4(stage + ((size_t)(t * k + first) * s.hidden + channel) * 2);
            }
#pragma unroll
            for (int b = 0; b < EPX_LL_BATCH; b++) {
                const int j = j0 + b;
                if (j >= k)
                    break;
                const int64_t e = idx[j];
                if (e < 0 || !ok[e / L])
                    continue;
                const __nv_bfloat16 *y = reinterpret_cast<const __nv_bfloat16 *>(&raw[b]);
                for (int i = 0; i < 8; i++)
                    acc[i] = __fadd_rn(acc[i], __fmul_rn(w[b], __bfloat162float(y[i])));
            }
        }
        int4 packed;
        __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(&packed);
        for (int i = 0; i < 8; i++)
            o[i] = __float2bfloat16_rn(acc[i]);
        epx_st_v4(reinterpret_cast<char *>(op.out) + ((size_t)t * op.out_stride + channel) * 2,
                  packed);
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
