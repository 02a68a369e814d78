/*
 * Low-latency dispatch kernels (docs/LOW_LATENCY.md; the host backend's
 * src/ops/host/host_ll_dispatch.c is the oracle they match).
 *
 * Send (grid = SM budget, each block a contiguous range of tokens):
 *   1. give back this slot's previous results if the step had no combine (which would
 *      have), then wait until every unmasked receiver gave it back;
 *   2. place each (token, distinct expert) at cell i of the receiver's cells for
 *      [local expert][this rank], i counting up in token order: a histogram of the
 *      tokens before the block's range, then one warp walks the block's tokens in order;
 *   3. warps move (token, channel chunk) items: cast to fp8 once (per-128 scales, the
 *      same bits as host_ll_fp8.c, stored as the caller asked: fp32 or packed UE8M0) and
 *      store 16 bytes to every destination, or stage the row for NVSHMEM puts when a
 *      peer has no direct pointer;
 *   4. the last block writes the per-expert counts and raises the arrival flags.
 * Receive: wait for the sources' flags; every block computes where each source's rows
 *   start (source s after sources < s) and packs the cells in place: rows move down to
 *   their packed place. While an expert has at most M rows no cell that still has to be
 *   read is ever a packed place (those lie below M, where only source 0's cells are, and
 *   they stay), so the warps of the grid share those rows freely; an expert with more
 *   rows is packed by one block in order of destination, a batch at a time.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/nvshmem/ll_cast.cuh"
#include "ops/cuda/nvshmem/ll_device.cuh"

/* Count, per expert, the tokens in [begin, end) that send it a row. */
__device__ void epx_ll_histogram(const int64_t *topk_idx, int64_t idx_stride, int k, int E,
                                 int64_t begin, int64_t end, int32_t *hist)
{
    for (int64_t i = begin * k + threadIdx.x; i < end * k; i += blockDim.x) {
        int64_t t = i / k;
        int j = (int)(i % k);
        const int64_t *idx = topk_idx + t * idx_stride;
        int64_t e = idx[j];
        if (e >= 0 && e < E && !epx_ll_seen_before(idx, j, e))
            atomicAdd(&hist[e], 1);
    }
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

static __device__ __forceinline__ void epx_ll_dispatch_send(epx_ll_shape_t s, epx_ll_op_t op)
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
            smem64[i] = epx_ll_expert_or_none(s, EPX_LL_STAGE_DISPATCH, i,
                                              op.topk_idx[(i / k) * op.idx_stride + i % k]);
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
    const int fp8 = op.use_fp8, ue8m0 = op.use_ue8m0;
    const size_t slot_base = s.slot[slot];
    const int64_t S = s.scale_cols;
    /* A cell's row and scale row as this call stores them. */
    const size_t row_bytes = fp8 ? (size_t)s.hidden : (size_t)s.hidden * 2;
    const int64_t scale_words = ue8m0 ? s.hidden / EPX__UE8M0_GROUP : S;

    if (blockIdx.x == 0)
        epx_ll_give_back(s, slot, seq - 1);
    epx_ll_wait_peers(s, EPX_LL_KIND_DISPATCH_DONE, slot, seq - 1, EPX_LL_STAGE_DISPATCH_RELEASE,
                      ok);

    const int64_t per = (T + gridDim.x - 1) / gridDim.x;
    const int64_t t0 = min(T, (int64_t)blockIdx.x * per), t1 = min(T, t0 + per);
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        hist[i] = 0;
    __syncthreads();
    epx_ll_histogram(topk_idx, idx_stride, k, s.num_experts, 0, t0, hist);
    __syncthreads();

    /* Channels per lane and per warp item: fp8 16 (a 512-channel item), bf16 8 (256). */
    const int lane_channels = fp8 ? 16 : 8;
    const int64_t item_channels = 32 * lane_channels;
    const int64_t chunks = (s.hidden + item_channels - 1) / item_channels;
    char *own = s.sym + slot_base;

    for (int64_t c0 = t0; c0 < t1; c0 += C) {
        const int n = (int)min((int64_t)C, t1 - c0);
        for (int i = threadIdx.x; i < n * k; i += blockDim.x) {
            const int64_t *idx = topk_idx + (c0 + i / k) * idx_stride;
            int j = i % k;
            /* Uncached ids are read raw: each block records its own tokens' bad ones. */
            int64_t e = epx_ll_expert_or_none(s, EPX_LL_STAGE_DISPATCH, (c0 + i / k) * k + j,
                                              idx[j], !cached);
            chunk_expert[i] = (e >= 0 && !epx_ll_seen_before(idx, j, idx[j])) ? (int32_t)e : -1;
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
            dst_row[i] = dst + s.recv_x + (size_t)cell * row_bytes;
            if (fp8)
                dst_scales[i] = reinterpret_cast<float *>(dst + s.recv_scales) + cell * scale_words;
            reinterpret_cast<int32_t *>(dst + s.recv_src_info)[cell] = (int32_t)(c0 + i / k);
            reinterpret_cast<int32_t *>(dst + s.recv_topk)[cell] = i % k;
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
            /* UE8M0: the item's four groups (lanes 0, 8, 16, 24) make one packed word,
             * group g in byte g % 4, stored by lane 0 as scale "column" item % chunks. */
            if (ue8m0) {
                const uint32_t exponent = (__float_as_uint(scale) >> 23) & 0xffu;
                uint32_t word = 0;
                for (int b = 0; b < 4; b++)
                    word |= __shfl_sync(0xffffffffu, exponent, 8 * b) << (8 * b);
                scale = __uint_as_float(word);
            }
            if (channel >= s.hidden)
                continue;
            const size_t byte = (size_t)channel * (fp8 ? 1 : 2);
            const int scale_writer = fp8 && (ue8m0 ? lane == 0 : (lane & 7) == 0);
            const int64_t group = ue8m0 ? item % chunks : channel / EPX__FP8_BLOCK;
            if (s.use_puts) {
                /* Staged for the puts below (and for every peer without a pointer). */
                epx_st_v4(own + s.send_x + (size_t)t * row_bytes + byte, data);
                if (scale_writer)
                    reinterpret_cast<float *>(own + s.send_scales)[t * scale_words + group] = scale;
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
                nvshmemx_putmem_nbi_warp(own + s.recv_x + (size_t)cell * row_bytes,
                                         own + s.send_x + (size_t)t * row_bytes, row_bytes, r);
                if (fp8)
                    nvshmemx_putmem_nbi_warp(
                        own + s.recv_scales + (size_t)(cell * scale_words) * sizeof(float),
                        own + s.send_scales + (size_t)(t * scale_words) * sizeof(float),
                        (size_t)scale_words * sizeof(float), r);
                if (lane == 0) {
                    nvshmem_int_p(reinterpret_cast<int *>(own + s.recv_src_info) + cell, (int)t, r);
                    nvshmem_int_p(reinterpret_cast<int *>(own + s.recv_topk) + cell, i % k, r);
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
    epx_ll_histogram(topk_idx, idx_stride, k, s.num_experts, 0, T, hist);
    __syncthreads();
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x) {
        const int r = i / L;
        if (ok[r])
            epx_ll_put_int(s, r, slot_base + s.sent_count + ((size_t)(i % L) * R + me) * 4, hist[i]);
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

/* Where the cells and the packed rows of one receive lie, and their sizes this call. */
struct epx_ll_pack_t {
    char *x, *scales;
    int32_t *src_info, *topk, *src_rank;
    size_t row_bytes;
    int64_t scale_words; /* int32 words a row's scales take: fp32 S, UE8M0 hidden / 512 */
};

/* Warp copy of cell `cell` to row `row` (different places) and the row's source. */
__device__ __forceinline__ void epx_ll_pack_row(const epx_ll_pack_t &p, int64_t cell, int64_t row,
                                                int src, int lane)
{
    if (cell != row) {
        epx_ll_warp_copy(p.x + (size_t)row * p.row_bytes, p.x + (size_t)cell * p.row_bytes,
                         p.row_bytes, lane);
        const int32_t *from = reinterpret_cast<const int32_t *>(p.scales) + cell * p.scale_words;
        int32_t *to = reinterpret_cast<int32_t *>(p.scales) + row * p.scale_words;
        for (int64_t w = lane; w < p.scale_words; w += 32)
            to[w] = __ldcg(from + w);
        if (lane == 0) {
            p.src_info[row] = __ldcg(p.src_info + cell);
            p.topk[row] = __ldcg(p.topk + cell);
        }
    }
    if (lane == 0)
        p.src_rank[row] = src;
}

/* Vectors (16 bytes) each thread holds while a block packs a crowded expert. */
#define EPX_LL_PACK_DEPTH 4

/*
 * Pack expert e's `total` rows when they may overlap cells not yet read (more than M
 * rows): the whole block moves rows in order of destination, a batch at a time, each
 * batch read completely before it is written. A row never moves up (its cell index is
 * at least its row index), so a batch's writes land below every later batch's cells.
 */
__device__ void epx_ll_pack_crowded(const epx_ll_pack_t &p, const epx_ll_shape_t &s, int e,
                                    const int32_t *first, int32_t total)
{
    const int R = s.world;
    const int64_t vectors = (int64_t)(p.row_bytes / 16);
    const int64_t budget = (int64_t)EPX_LL_PACK_DEPTH * EPX_LL_THREADS;
    /* Rows per batch: what the registers hold (at least 1: a row alone may be copied in
     * place, its cell and its row never overlap), at most a word of scales per thread. */
    int64_t batch = vectors <= budget ? budget / vectors : 1;
    if (p.scale_words > 0 && batch * p.scale_words > EPX_LL_THREADS)
        batch = max((int64_t)1, EPX_LL_THREADS / p.scale_words);
    batch = min(batch, (int64_t)EPX_LL_THREADS);
    const int64_t base = (int64_t)e * s.rows;
    for (int64_t d0 = 0; d0 < total; d0 += batch) {
        const int64_t n = min(batch, (int64_t)total - d0);
        if (n * vectors > budget) {
            /* One row bigger than the registers: copy it directly (n == 1). */
            const int src = epx_ll_find(first, R, (int32_t)d0);
            const int64_t cell = base + (int64_t)src * s.max_tokens + (d0 - first[src]);
            if ((threadIdx.x >> 5) == 0)
                epx_ll_pack_row(p, cell, base + d0, src, threadIdx.x & 31);
            __syncthreads();
            continue;
        }
        int4 v[EPX_LL_PACK_DEPTH];
        int32_t word = 0, info = 0, topk = 0;
        /* Read the batch. */
#pragma unroll
        for (int u = 0; u < EPX_LL_PACK_DEPTH; u++) {
            const int64_t i = (int64_t)u * EPX_LL_THREADS + threadIdx.x;
            if (i < n * vectors) {
                const int64_t d = d0 + i / vectors;
                const int src = epx_ll_find(first, R, (int32_t)d);
                const int64_t cell = base + (int64_t)src * s.max_tokens + (d - first[src]);
                v[u] = *reinterpret_cast<const int4 *>(p.x + (size_t)cell * p.row_bytes +
                                                       (size_t)(i % vectors) * 16);
            }
        }
        const int64_t d_word = p.scale_words > 0 ? d0 + threadIdx.x / p.scale_words : -1;
        const int has_word = p.scale_words > 0 && threadIdx.x < n * p.scale_words;
        if (has_word) {
            const int src = epx_ll_find(first, R, (int32_t)d_word);
            const int64_t cell = base + (int64_t)src * s.max_tokens + (d_word - first[src]);
            word = reinterpret_cast<const int32_t *>(p.scales)[cell * p.scale_words +
                                                               threadIdx.x % p.scale_words];
        }
        const int src_here = threadIdx.x < n ? epx_ll_find(first, R, (int32_t)(d0 + threadIdx.x)) : 0;
        if (threadIdx.x < n) {
            const int64_t d = d0 + threadIdx.x;
            const int64_t cell = base + (int64_t)src_here * s.max_tokens + (d - first[src_here]);
            info = p.src_info[cell];
            topk = p.topk[cell];
        }
        __syncthreads();
        /* Write it. */
#pragma unroll
        for (int u = 0; u < EPX_LL_PACK_DEPTH; u++) {
            const int64_t i = (int64_t)u * EPX_LL_THREADS + threadIdx.x;
            if (i < n * vectors)
                *reinterpret_cast<int4 *>(p.x + (size_t)(base + d0 + i / vectors) * p.row_bytes +
                                          (size_t)(i % vectors) * 16) = v[u];
        }
        if (has_word)
            reinterpret_cast<int32_t *>(p.scales)[(base + d_word) * p.scale_words +
                                                  threadIdx.x % p.scale_words] = word;
        if (threadIdx.x < n) {
            const int64_t row = base + d0 + threadIdx.x;
            p.src_info[row] = info;
            p.topk[row] = topk;
            p.src_rank[row] = src_here;
        }
        __syncthreads();
    }
}

static __device__ __forceinline__ void epx_ll_dispatch_recv(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int32_t smem[];
    const int R = s.world, L = s.num_local, slot = op.slot, lane = threadIdx.x & 31;
    int32_t *ok = smem;          /* [R] */
    int32_t *first = smem + R;   /* [L][R + 1]: first packed row of each source, then the total */
    int32_t *spread_first = first + L * (R + 1); /* [L + 1]: the grid-shared rows before each expert */
    const uint64_t seq = epx_ll_seq(s, slot, 0);
    epx_ll_wait_peers(s, EPX_LL_KIND_DISPATCH, slot, seq, EPX_LL_STAGE_DISPATCH, ok);

    char *sym = s.sym + s.slot[slot];
    char *out = s.local[slot];
    const int32_t *counts = reinterpret_cast<const int32_t *>(sym + s.sent_count);
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        int32_t pos = 0;
        for (int src = 0; src < R; src++) {
            first[e * (R + 1) + src] = pos;
            pos += ok[src] ? __ldcg(counts + e * R + src) : 0;
        }
        first[e * (R + 1) + R] = pos;
    }
    __syncthreads();
    /* Experts with at most M rows are packed by all warps of the grid together. */
    if (threadIdx.x == 0) {
        int32_t pos = 0;
        for (int e = 0; e < L; e++) {
            spread_first[e] = pos;
            const int32_t total = first[e * (R + 1) + R];
            pos += total <= s.max_tokens ? total : 0;
        }
        spread_first[L] = pos;
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
            const int e = i / R, src = i % R;
            const int64_t begin = first[e * (R + 1) + src];
            const int64_t count = first[e * (R + 1) + src + 1] - begin;
            reinterpret_cast<int64_t *>(sym + s.recv_range)[i] =
                (int64_t)(((uint64_t)begin << 32) | (uint64_t)count);
        }
        for (int e = threadIdx.x; e < L; e += blockDim.x) {
            reinterpret_cast<int32_t *>(out + s.recv_count)[e] = first[e * (R + 1) + R];
            /* DeepEP's cumulative_local_expert_recv_stats (stream order: no atomics). */
            if (op.recv_stats != NULL)
                op.recv_stats[e] += first[e * (R + 1) + R];
        }
    }

    epx_ll_pack_t p;
    p.x = sym + s.recv_x;
    p.scales = sym + s.recv_scales;
    p.src_info = reinterpret_cast<int32_t *>(sym + s.recv_src_info);
    p.topk = reinterpret_cast<int32_t *>(sym + s.recv_topk);
    p.src_rank = reinterpret_cast<int32_t *>(out + s.recv_src_rank);
    p.row_bytes = op.use_fp8 ? (size_t)s.hidden : (size_t)s.hidden * 2;
    p.scale_words = !op.use_fp8 ? 0 : (op.use_ue8m0 ? s.hidden / EPX__UE8M0_GROUP : s.scale_cols);

    const int warps = gridDim.x * EPX_LL_WARPS;
    for (int g = blockIdx.x * EPX_LL_WARPS + (threadIdx.x >> 5); g < spread_first[L]; g += warps) {
        const int e = epx_ll_find(spread_first, L, g);
        const int32_t *f = first + e * (R + 1);
        const int i = g - spread_first[e];
        const int src = epx_ll_find(f, R, i);
        const int64_t cell = ((int64_t)e * R + src) * s.max_tokens + (i - f[src]);
        epx_ll_pack_row(p, cell, (int64_t)e * s.rows + i, src, lane);
    }
    /* Crowded experts, one block each. */
    int crowded = 0;
    for (int e = 0; e < L; e++) {
        const int32_t total = first[e * (R + 1) + R];
        if (total <= s.max_tokens)
            continue;
        if (crowded++ % (int)gridDim.x == (int)blockIdx.x)
            epx_ll_pack_crowded(p, s, e, first + e * (R + 1), total);
    }
}

/*
 * The one kernel of a low-latency dispatch, for its send and its receive phase alike, so that
 * a profiler lists one "dispatch" kernel, as for DeepEP (whose tests time its kernels by
 * name): the phases are the two launches of it.
 */
namespace epx {
namespace ll {
__global__ void __launch_bounds__(EPX_LL_THREADS) dispatch(epx_ll_shape_t s, epx_ll_op_t op, int phase)
{
    if (phase == EPX_LL_PHASE_SEND)
        epx_ll_dispatch_send(s, op);
    else
        epx_ll_dispatch_recv(s, op);
}
} // namespace ll
} // namespace epx

extern "C" int epx_ll_launch_dispatch_send(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                           void *stream)
{
    size_t smem = epx_ll_send_smem(s->num_experts, s->topk, s->world, op->tokens);
    epx::ll::dispatch<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op, EPX_LL_PHASE_SEND);
    return (int)cudaGetLastError();
}

extern "C" int epx_ll_launch_dispatch_recv(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                           void *stream)
{
    size_t smem = epx_ll_recv_smem(s->num_local, s->world);
    epx::ll::dispatch<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op, EPX_LL_PHASE_RECV);
    return (int)cudaGetLastError();
}
