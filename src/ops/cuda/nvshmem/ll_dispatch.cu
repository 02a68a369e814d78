/*
 * Low-latency dispatch kernels (docs/LOW_LATENCY.md; the host backend's
 * src/ops/ref/host_ll_dispatch.c is the oracle they match).
 *
 * Send (grid = SM budget, each block a contiguous range of tokens):
 *   1. wait until every unmasked receiver released this slot's previous dispatch;
 *   2. place each (token, distinct expert) at row i of the receiver's staging
 *      [local expert][this rank][i], i counting up in token order: a histogram of the
 *      tokens before the block's range, then one warp walks the block's tokens in order;
 *   3. warps move (token, channel chunk) items: cast to fp8 once (per-128 scales, the
 *      same bits as host_ll_fp8.c) and store 16 bytes to every destination, or stage the
 *      row for NVSHMEM puts when a peer has no direct pointer;
 *   4. the last block writes the per-expert counts and raises the arrival flags.
 * Receive: wait for the sources' flags; every block computes where each source's rows
 * start (source s after sources < s) and the warps of the grid share all rows evenly,
 * copying them with their scales and source info; then release the slot.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/nvshmem/ll_device.cuh"

/* Count, per expert, the tokens in [begin, end) that send it a row. */
__device__ void epx_ll_histogram(const int64_t *topk_idx, int64_t idx_stride, int k,
                                 int64_t begin, int64_t end, int32_t *hist)
{
    for (int64_t i = begin * k + threadIdx.x; i < end * k; i += blockDim.x) {
        int64_t t = i / k;
        int j = (int)(i % k);
        const int64_t *idx = topk_idx + t * idx_stride;
        int64_t e = idx[j];
        if (e >= 0 && !epx_ll_seen_before(idx, j, e))
            atomicAdd(&hist[e], 1);
    }
}

/* fp8 e4m3 of 16 bf16 channels (this lane's) with the 8-lane group's scale. */
__device__ __forceinline__ int4 epx_ll_cast16(const int4 lo, const int4 hi, int round_scale,
                                              float *scale_out)
{
    __nv_bfloat16 v[16];
    *reinterpret_cast<int4 *>(&v[0]) = lo;
    *reinterpret_cast<int4 *>(&v[8]) = hi;
    float f[16], amax = 0.0f;
    for (int i = 0; i < 16; i++) {
        f[i] = __bfloat162float(v[i]);
        amax = fmaxf(amax, fabsf(f[i]));
    }
    /* The 8 lanes of a 128-channel group share one amax. */
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    amax = amax > 1e-4f ? amax : 1e-4f;
    float scale, multiplier;
    if (round_scale) {
        int exponent;
        float fraction = frexpf(__fdiv_rn(amax, 448.0f), &exponent);
        if (fraction == 0.5f)
            exponent -= 1;
        scale = ldexpf(1.0f, exponent);
        multiplier = ldexpf(1.0f, -exponent);
    } else {
        scale = __fdiv_rn(amax, 448.0f);
        multiplier = __fdiv_rn(448.0f, amax);
    }
    *scale_out = scale;
    int4 out;
    unsigned char *bytes = reinterpret_cast<unsigned char *>(&out);
    for (int i = 0; i < 16; i++)
        bytes[i] = (unsigned char)__nv_cvt_float_to_fp8(__fmul_rn(f[i], multiplier),
                                                        __NV_SATFINITE, __NV_E4M3);
    return out;
}

/* This lane's bf16 input of send item `item` (token c0 + item / chunks): 16 bytes, or 32
 * for fp8 (16 channels); nothing past hidden. */
__device__ __forceinline__ void epx_ll_load_item(const epx_ll_op_t &op, int64_t c0, int64_t item,
                                                 int64_t chunks, int64_t item_channels,
                                                 int64_t lane_offset, int64_t hidden, int fp8,
                                                 int4 *lo, int4 *hi)
{
    const int64_t channel = (item % chunks) * item_channels + lane_offset;
    if (channel >= hidden)
        return;
    const char *x = reinterpret_cast<const char *>(op.x) + (size_t)(c0 + item / chunks) * op.x_stride * 2;
    *lo = epx_ld_nc_v4(x + channel * 2);
    if (fp8)
        *hi = epx_ld_nc_v4(x + channel * 2 + 16);
}

__global__ void __launch_bounds__(EPX_LL_THREADS)
    epx_ll_dispatch_send_kernel(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int64_t smem64[];
    const int R = s.world, me = s.rank, k = s.topk, L = s.num_local, C = epx_ll_chunk_tokens(k);
    const int64_t T = op.tokens;
    /* The routing: a copy in shared memory when small (it is read several times). */
    const int cached = epx_ll_cache_routing(T, k);
    const int64_t *topk_idx = cached ? smem64 : op.topk_idx;
    const int64_t idx_stride = cached ? k : op.idx_stride;
    if (cached) {
        for (int64_t i = threadIdx.x; i < T * k; i += blockDim.x)
            smem64[i] = op.topk_idx[(i / k) * op.idx_stride + i % k];
    }
    /* Where each (token, expert) of the chunk goes: its row and its scales at the
     * receiver, NULL when not stored directly (skipped, masked, or sent by a put). */
    char **dst_row = reinterpret_cast<char **>(smem64 + (cached ? T * k : 0));
    float **dst_scales = reinterpret_cast<float **>(dst_row + C * k);
    int32_t *smem = reinterpret_cast<int32_t *>(dst_scales + C * k);
    int32_t *hist = smem;
    int32_t *chunk_expert = hist + s.num_experts; /* [C][k] expert of a first occurrence, or -1 */
    int32_t *chunk_row = chunk_expert + C * k;    /* [C][k] row at the receiver */
    int32_t *ok = chunk_row + C * k;              /* [R] */
    __shared__ int last;
    const int slot = op.slot, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint64_t seq = epx_ll_seq(s, slot, 0) + 1;
    const int fp8 = op.use_fp8;
    const size_t slot_base = s.slot[slot];
    const int64_t S = s.scale_cols;

    epx_ll_wait_peers(s, EPX_LL_KIND_DISPATCH_DONE, slot, seq - 1, EPX_LL_STAGE_DISPATCH_RELEASE,
                      ok);

    const int64_t per = (T + gridDim.x - 1) / gridDim.x;
    const int64_t t0 = min(T, (int64_t)blockIdx.x * per), t1 = min(T, t0 + per);
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        hist[i] = 0;
    __syncthreads();
    epx_ll_histogram(topk_idx, idx_stride, k, 0, t0, hist);
    __syncthreads();

    /* Channels per lane and per warp item: fp8 16 (a 512-channel item), bf16 8 (256). */
    const int lane_channels = fp8 ? 16 : 8;
    const int64_t item_channels = 32 * lane_channels;
    const int64_t chunks = (s.hidden + item_channels - 1) / item_channels;
    const size_t row_bytes = fp8 ? (size_t)s.hidden : (size_t)s.hidden * 2;
    char *own = s.sym + slot_base;

    for (int64_t c0 = t0; c0 < t1; c0 += C) {
        const int n = (int)min((int64_t)C, t1 - c0);
        for (int i = threadIdx.x; i < n * k; i += blockDim.x) {
            const int64_t *idx = topk_idx + (c0 + i / k) * idx_stride;
            int j = i % k;
            int64_t e = idx[j];
            chunk_expert[i] = (e >= 0 && !epx_ll_seen_before(idx, j, e)) ? (int32_t)e : -1;
        }
        __syncthreads();
        /* Rows in token order: one warp walks the tokens (a token's experts are distinct). */
        if (warp == 0) {
            for (int tt = 0; tt < n; tt++) {
                for (int j = lane; j < k; j += 32) {
                    int e = chunk_expert[tt * k + j];
                    if (e >= 0)
                        chunk_row[tt * k + j] = atomicAdd(&hist[e], 1);
                }
                __syncwarp();
            }
        }
        __syncthreads();
        /* Each entry's destination once (the header goes now), and its place kept for
         * combine, which reads the row back where the expert's rank put it. */
        int32_t *send_pos = reinterpret_cast<int32_t *>(s.local[slot] + s.send_pos) + c0 * k;
        for (int i = threadIdx.x; i < n * k; i += blockDim.x) {
            const int e = chunk_expert[i];
            send_pos[i] = e >= 0 ? chunk_row[i] : -1;
            dst_row[i] = NULL;
            dst_scales[i] = NULL;
            if (e < 0)
                continue;
            const int r = e / L;
            char *base = s.peer[r];
            if (!ok[r] || base == NULL)
                continue;
            const int64_t cell = ((int64_t)(e % L) * R + me) * s.max_tokens + chunk_row[i];
            char *dst = base + slot_base;
            dst_row[i] = dst + s.stage_x + (size_t)cell * s.x_row_bytes;
            if (fp8)
                dst_scales[i] = reinterpret_cast<float *>(dst + s.stage_scales) + cell * S;
            reinterpret_cast<int32_t *>(dst + s.stage_token)[cell] = (int32_t)(c0 + i / k);
            reinterpret_cast<int32_t *>(dst + s.stage_topk)[cell] = i % k;
        }
        __syncthreads();

        /* Software-pipelined: the next item's loads are in flight while this one is
         * cast and stored. */
        const int64_t items = (int64_t)n * chunks;
        const int64_t lane_offset = (int64_t)lane * lane_channels;
        int4 lo = make_int4(0, 0, 0, 0), hi = lo;
        if (warp < items)
            epx_ll_load_item(op, c0, warp, chunks, item_channels, lane_offset, s.hidden, fp8, &lo,
                             &hi);
        for (int64_t item = warp; item < items; item += EPX_LL_WARPS) {
            int4 next_lo = make_int4(0, 0, 0, 0), next_hi = next_lo;
            if (item + EPX_LL_WARPS < items)
                epx_ll_load_item(op, c0, item + EPX_LL_WARPS, chunks, item_channels, lane_offset,
                                 s.hidden, fp8, &next_lo, &next_hi);
            const int tt = (int)(item / chunks);
            const int64_t t = c0 + tt;
            const int64_t channel = (item % chunks) * item_channels + lane_offset;
            float scale = 0.0f;
            const int4 data = fp8 ? epx_ll_cast16(lo, hi, op.round_scale, &scale) : lo;
            lo = next_lo;
            hi = next_hi;
            if (channel >= s.hidden)
                continue;
            const size_t byte = (size_t)channel * (fp8 ? 1 : 2);
            const int scale_writer = fp8 && (lane & 7) == 0;
            const int64_t group = channel / 128;
            if (s.use_puts) {
                /* Staged for the puts below (and for every peer without a pointer). */
                epx_st_v4(own + s.send_x + (size_t)t * s.x_row_bytes + byte, data);
                if (scale_writer)
                    reinterpret_cast<float *>(own + s.send_scales)[t * S + group] = scale;
            }
            char *const *rows = dst_row + tt * k;
            float *const *scales = dst_scales + tt * k;
            for (int j = 0; j < k; j++) {
                char *row = rows[j];
                if (row == NULL)
                    continue;
                epx_st_v4(row + byte, data);
                if (scale_writer)
                    scales[j][group] = scale;
            }
        }
        __syncthreads();

        if (s.use_puts) {
            /* Peers without a direct pointer: one put per (token, expert) row. */
            for (int i = warp; i < n * k; i += EPX_LL_WARPS) {
                const int e = chunk_expert[i];
                if (e < 0)
                    continue;
                const int r = e / L;
                if (!ok[r] || s.peer[r] != NULL)
                    continue;
                const int64_t t = c0 + i / k;
                const int64_t cell = ((int64_t)(e % L) * R + me) * s.max_tokens + chunk_row[i];
                nvshmemx_putmem_nbi_warp(own + s.stage_x + (size_t)cell * s.x_row_bytes,
                                         own + s.send_x + (size_t)t * s.x_row_bytes, row_bytes, r);
                if (fp8)
                    nvshmemx_putmem_nbi_warp(
                        own + s.stage_scales + (size_t)(cell * S) * sizeof(float),
                        own + s.send_scales + (size_t)(t * S) * sizeof(float),
                        (size_t)S * sizeof(float), r);
                if (lane == 0) {
                    nvshmem_int_p(reinterpret_cast<int *>(own + s.stage_token) + cell, (int)t, r);
                    nvshmem_int_p(reinterpret_cast<int *>(own + s.stage_topk) + cell, i % k, r);
                }
            }
        }
        __syncthreads();
    }

    if (!epx_ll_last_block(s, s.arrive + slot * 4 + EPX_LL_ARRIVE_DISPATCH_SEND, &last))
        return;
    /* Counts per (receiver, local expert) over all tokens, then the flags. */
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        hist[i] = 0;
    __syncthreads();
    epx_ll_histogram(topk_idx, idx_stride, k, 0, T, hist);
    __syncthreads();
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x) {
        const int r = i / L;
        if (ok[r])
            epx_ll_put_int(s, r, slot_base + s.stage_count + ((size_t)(i % L) * R + me) * 4, hist[i]);
    }
    if (s.use_puts)
        nvshmem_quiet();
    __threadfence_system();
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (ok[r])
            epx_ll_signal(s, r, EPX_LL_KIND_DISPATCH, slot, seq);
    if (threadIdx.x == 0)
        s.seq[slot * 2] = seq;
}

__global__ void __launch_bounds__(EPX_LL_THREADS)
    epx_ll_dispatch_recv_kernel(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int32_t smem[];
    const int R = s.world, L = s.num_local, slot = op.slot, lane = threadIdx.x & 31;
    int32_t *ok = smem;          /* [R] */
    int32_t *first = smem + R;   /* [L][R + 1]: first packed row of each source, then the total */
    int32_t *expert_first = first + L * (R + 1); /* [L + 1]: first row of each expert, all rows */
    __shared__ int last;
    const uint64_t seq = epx_ll_seq(s, slot, 0);
    epx_ll_wait_peers(s, EPX_LL_KIND_DISPATCH, slot, seq, EPX_LL_STAGE_DISPATCH, ok);

    const char *stage = s.sym + s.slot[slot];
    char *out = s.local[slot];
    const int32_t *counts = reinterpret_cast<const int32_t *>(stage + s.stage_count);
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        int32_t pos = 0;
        for (int src = 0; src < R; src++) {
            first[e * (R + 1) + src] = pos;
            pos += ok[src] ? __ldcg(counts + e * R + src) : 0;
        }
        first[e * (R + 1) + R] = pos;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t pos = 0;
        for (int e = 0; e < L; e++) {
            expert_first[e] = pos;
            pos += first[e * (R + 1) + R];
        }
        expert_first[L] = pos;
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
            const int e = i / R, src = i % R;
            const int64_t begin = first[e * (R + 1) + src];
            const int64_t count = first[e * (R + 1) + src + 1] - begin;
            reinterpret_cast<int64_t *>(s.sym + s.slot[slot] + s.recv_range)[i] =
                (int64_t)(((uint64_t)begin << 32) | (uint64_t)count);
        }
        for (int e = threadIdx.x; e < L; e += blockDim.x)
            reinterpret_cast<int32_t *>(out + s.recv_count)[e] = first[e * (R + 1) + R];
    }

    /* The warps of the grid share all received rows evenly. */
    const int fp8 = op.use_fp8, ue8m0 = op.use_ue8m0;
    const size_t row_bytes = fp8 ? (size_t)s.hidden : (size_t)s.hidden * 2;
    const int64_t S = s.scale_cols, words = s.hidden / 512;
    const int warps = gridDim.x * EPX_LL_WARPS;
    for (int g = blockIdx.x * EPX_LL_WARPS + (threadIdx.x >> 5); g < expert_first[L]; g += warps) {
        {
            const int e = epx_ll_find(expert_first, L, g);
            const int32_t *f = first + e * (R + 1);
            const int i = g - expert_first[e];
            const int src = epx_ll_find(f, R, i);
            const int64_t cell = ((int64_t)e * R + src) * s.max_tokens + (i - f[src]);
            const int64_t row = (int64_t)e * s.rows + i;
            epx_ll_warp_copy(out + s.recv_x + (size_t)row * row_bytes,
                             stage + s.stage_x + (size_t)cell * s.x_row_bytes, row_bytes, lane);
            const float *scales = reinterpret_cast<const float *>(stage + s.stage_scales) + cell * S;
            if (ue8m0) {
                uint32_t *packed = reinterpret_cast<uint32_t *>(out + s.recv_scales) + row * words;
                for (int64_t w = lane; w < words; w += 32) {
                    uint32_t word = 0;
                    for (int b = 0; b < 4; b++)
                        word |= ((__float_as_uint(__ldcg(scales + w * 4 + b)) >> 23) & 0xffu) << (8 * b);
                    packed[w] = word;
                }
            } else if (fp8) {
                float *dst = reinterpret_cast<float *>(out + s.recv_scales) + row * S;
                for (int64_t g = lane; g < S; g += 32)
                    dst[g] = __ldcg(scales + g);
            }
            if (lane == 0) {
                reinterpret_cast<int32_t *>(out + s.recv_src_info)[row] =
                    __ldcg(reinterpret_cast<const int32_t *>(stage + s.stage_token) + cell);
                reinterpret_cast<int32_t *>(out + s.recv_topk)[row] =
                    __ldcg(reinterpret_cast<const int32_t *>(stage + s.stage_topk) + cell);
                reinterpret_cast<int32_t *>(out + s.recv_src_rank)[row] = src;
            }
        }
    }

    /* Done with the staging: the sources may fill this slot again. */
    if (!epx_ll_last_block(s, s.arrive + slot * 4 + EPX_LL_ARRIVE_DISPATCH_RECV, &last))
        return;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (ok[r])
            epx_ll_signal(s, r, EPX_LL_KIND_DISPATCH_DONE, slot, seq);
}

extern "C" int epx_ll_launch_dispatch_send(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                           void *stream)
{
    size_t smem = epx_ll_send_smem(s->num_experts, s->topk, s->world, op->tokens);
    epx_ll_dispatch_send_kernel<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op);
    return (int)cudaGetLastError();
}

extern "C" int epx_ll_launch_dispatch_recv(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                           void *stream)
{
    size_t smem = epx_ll_recv_smem(s->num_local, s->world);
    epx_ll_dispatch_recv_kernel<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op);
    return (int)cudaGetLastError();
}
