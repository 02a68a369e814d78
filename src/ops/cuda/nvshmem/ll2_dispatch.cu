/*
 * Kernels 2 of the low-latency dispatch (EPX_LL_KERNELS=2; docs/LOW_LATENCY.md, "Kernels
 * 2"; src/ops/host/host_ll_dispatch.c is the oracle they match): every row is written
 * once, by its sender, at its final packed place in the receiver's recv_x, so the
 * receive moves no rows.
 *
 * What moves: each (token, distinct expert) of this rank goes to expert e's rank as one
 * row (fp8 cast once per token, or bf16) with its scales, source token and top-k
 * position, at packed row base[e] + i of expert e, where i counts this rank's earlier
 * tokens that chose e and base[e] is the rows all lower ranks send e. Rows are therefore
 * in source-rank, then token order, as the oracle has them, and bit-exact.
 *
 * Send (grid = SM budget; each block a contiguous range of tokens):
 *   1. block 0 gives back this slot's previous results if that step had no combine; all
 *      blocks wait until every unmasked receiver gave the slot back (usually long done)
 *      with DISPATCH_DONE; with inferred releases, when the step had a combine, a direct
 *      peer gave it back with its outputs-ready flag, which this rank's combine already
 *      waited for (ll2_device.cuh, "slot releases"), so nothing is read from it here;
 *   2. every block counts the rows of all tokens per expert (hist) and those before its
 *      range (before); block b publishes this rank's counts to receivers b, b + grid, ...:
 *      E + 1 tagged words per receiver (the counts, then the units the receiver must see
 *      arrive), stores for direct peers, one put with a signal for the others
 *      (ll2_device.cuh);
 *   3. every block adds up the counts of the lower ranks (waiting for their words: this
 *      is the count exchange, one hop; a send therefore waits until every lower rank has
 *      started its own send), giving base[e];
 *   4. warps cast and store (token, channel chunk) items to every destination, several
 *      items' loads in flight per warp; rows for peers reached only by NVSHMEM puts are
 *      staged instead, in the receivers' order;
 *   5. each block adds its row count to each direct receiver's arrival counter (one
 *      release reduction per receiver and block: no grid-wide completion); the last block
 *      (a GPU-scope counter) advances the sequence number and sends the staged rows for
 *      put peers, one batch of 4 puts per (expert, receiver), the last with a signal.
 * Receive (one block; in a call without EPX_LL_SEND_ONLY block 0 of the send runs it):
 *   read the counts of every source for this rank's experts (the tagged words), write
 *   recv_count, recv_layout_range, the source rank of every row and the recv stats, then
 *   wait until each source's arrival counter reaches what the source announced. With
 *   wait_recv_cost_stats a timing pass comes first: one thread a source waits for that
 *   source's units word and rows and adds the time since the launch's start.
 * Bounds: shared memory epx_ll2_dispatch_smem (ll_plugin.h); num_topk <= EPX_LL2_MAX_TOPK.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/nvshmem/ll2_device.cuh"
#include "ops/cuda/nvshmem/ll_cast.cuh"

namespace {

/* The send part's shared memory (order as in epx_ll2_dispatch_smem). */
struct send_smem_t {
    char **dst_row;     /* [C*k] where the chunk's rows go (NULL: not sent) */
    char **dst_scales;  /* [C*k] their scale rows */
    int32_t *cache;     /* [EPX_LL2_CACHED_ENTRIES] first-occurrence expert of each entry, or -1 */
    int32_t *hist;      /* [E] rows this rank sends each expert */
    int32_t *before;    /* [E] of those, from tokens before the block's (then a running index) */
    int32_t *base;      /* [E] rows the lower ranks send each expert */
    int32_t *put_first; /* [E] where each expert's rows start in the put staging */
    int32_t *chunk_expert, *chunk_row; /* [C*k] */
    int32_t *ok;        /* [R] receiver unmasked and gave the slot back */
    int32_t *rows_block, *rows_to, *batches_to; /* [R] */
};

__device__ __forceinline__ send_smem_t send_smem(char *base, int experts, int topk, int world)
{
    const int entries = epx_ll2_chunk_tokens(topk) * topk;
    send_smem_t m;
    m.dst_row = reinterpret_cast<char **>(base);
    m.dst_scales = m.dst_row + entries;
    m.cache = reinterpret_cast<int32_t *>(m.dst_scales + entries);
    m.hist = m.cache + EPX_LL2_CACHED_ENTRIES;
    m.before = m.hist + experts;
    m.base = m.before + experts;
    m.put_first = m.base + experts;
    m.chunk_expert = m.put_first + experts;
    m.chunk_row = m.chunk_expert + entries;
    m.ok = m.chunk_row + entries;
    m.rows_block = m.ok + world;
    m.rows_to = m.rows_block + world;
    m.batches_to = m.rows_to + world;
    return m;
}

/*
 * Entry (t, j)'s expert when it is the first top-k position naming it, else -1; an id out
 * of range is -1, and recorded when `record` (one block's pass over all entries).
 */
__device__ __forceinline__ int entry_expert(const epx_ll_shape_t &s, const epx_ll_op_t &op,
                                            const int32_t *cache, int cached, int64_t t, int j,
                                            int k, int record)
{
    if (cached)
        return cache[t * k + j];
    const int64_t *idx = op.topk_idx + t * op.idx_stride;
    const int e = epx_ll_expert_or_none(s, EPX_LL_STAGE_DISPATCH, t * k + j, idx[j], record);
    return (e >= 0 && !epx_ll_seen_before(idx, j, e)) ? e : -1;
}

/* Call-wide values of the send part. */
struct send_ctx_t {
    int R, me, k, L, E, C, slot, cached, fp8, ue8m0;
    uint32_t tag;
    uint64_t seq;
    int64_t T, t0, t1, scale_words;
    size_t slot_base, row_bytes;
    char *own;
};

/*
 * Step 4 for one chunk of n tokens from c0: warps take (token, channel chunk) items,
 * kDepth of them loaded before any is cast and stored (a warp's loads in flight at once);
 * fp8: 16 channels a lane (a 512-channel item), bf16: 8 (256).
 */
template <bool kFp8>
__device__ void send_items(const epx_ll_shape_t &s, const epx_ll_op_t &op, const send_ctx_t &c,
                           const send_smem_t &m, int64_t c0, int n)
{
    constexpr int kLaneChannels = kFp8 ? 16 : 8;
    constexpr int64_t kItemChannels = 32 * kLaneChannels;
    constexpr int kDepth = kFp8 ? 4 : 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, k = c.k;
    /* 32-bit item arithmetic (n <= 32 tokens, hidden < 2^31): a 64-bit division is a
     * long instruction sequence, and each item needs four. */
    const int hidden = (int)s.hidden;
    const int chunks = (hidden + (int)kItemChannels - 1) / (int)kItemChannels;
    const int items = n * chunks;
    const int lane_offset = lane * kLaneChannels;
    const char *x = reinterpret_cast<const char *>(op.x);
    for (int b0 = warp; b0 < items; b0 += kDepth * EPX_LL_WARPS) {
        int4 lo[kDepth], hi[kDepth];
#pragma unroll
        for (int u = 0; u < kDepth; u++) {
            lo[u] = make_int4(0, 0, 0, 0);
            hi[u] = lo[u];
            const int item = b0 + u * EPX_LL_WARPS;
            const int channel = (item % chunks) * (int)kItemChannels + lane_offset;
            if (item < items && channel < hidden) {
                const char *row = x + (size_t)(c0 + item / chunks) * op.x_stride * 2;
                lo[u] = epx_ld_nc_v4(row + channel * 2);
                if (kFp8)
                    hi[u] = epx_ld_nc_v4(row + channel * 2 + 16);
            }
        }
#pragma unroll
        for (int u = 0; u < kDepth; u++) {
            const int item = b0 + u * EPX_LL_WARPS; /* uniform in the warp */
            if (item >= items)
                break;
            const int tt = item / chunks;
            const int channel = (item % chunks) * (int)kItemChannels + lane_offset;
            float scale = 0.0f;
            int4 data = lo[u];
            if (kFp8) {
                data = epx_ll_cast16(lo[u], hi[u], op.round_scale, &scale);
                /* UE8M0: the item's four groups (lanes 0, 8, 16, 24) make one packed
                 * word, group g in byte g % 4, stored by lane 0 as word item % chunks. */
                if (c.ue8m0) {
                    const uint32_t exponent = (__float_as_uint(scale) >> 23) & 0xffu;
                    uint32_t word = 0;
                    for (int b = 0; b < 4; b++)
                        word |= __shfl_sync(0xffffffffu, exponent, 8 * b) << (8 * b);
                    scale = __uint_as_float(word);
                }
            }
            if (channel >= hidden)
                continue;
            const size_t byte = (size_t)channel * (kFp8 ? 1 : 2);
            const int scale_writer = kFp8 && (c.ue8m0 ? lane == 0 : (lane & 7) == 0);
            const int group = c.ue8m0 ? item % chunks : channel / EPX__FP8_BLOCK;
            char *const *rows = m.dst_row + tt * k;
            char *const *scales = m.dst_scales + tt * k;
            for (int j = 0; j < k; j++) {
                char *row = rows[j];
                if (row == NULL)
                    continue;
                epx_st_v4(row + byte, data);
                if (scale_writer)
                    reinterpret_cast<float *>(scales[j])[group] = scale;
            }
        }
    }
}

/* Step 2's publication to receiver r: E counts and the units, as tagged words. */
__device__ void publish_counts(const epx_ll_shape_t &s, const send_ctx_t &c, const send_smem_t &m,
                               int r)
{
    const int E = c.E;
    char *peer = s.peer[r];
    const uint32_t units = (uint32_t)(peer != NULL ? m.rows_to[r] : m.batches_to[r]);
    const size_t table = c.slot_base + s.counts + (size_t)c.me * (size_t)(E + 1) * 8;
    if (peer != NULL) {
        uint64_t *words = reinterpret_cast<uint64_t *>(peer + table);
        for (int e = threadIdx.x; e <= E; e += blockDim.x)
            epx_ll2_st_relaxed_sys(words + e,
                                   epx_ll2_tagged(c.tag, e < E ? (uint32_t)m.hist[e] : units));
        return;
    }
    /* NVSHMEM puts read symmetric memory: the words are staged, then put whole with a
     * signal (this rank's DISPATCH flag at r, otherwise unused by kernels 2), which
     * NVSHMEM delivers after the data: a put need not write 8-byte words whole. */
    uint64_t *stage =
        reinterpret_cast<uint64_t *>(c.own + s.count_stage) + (size_t)r * (size_t)(E + 1);
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        stage[e] = epx_ll2_tagged(c.tag, e < E ? (uint32_t)m.hist[e] : units);
    __syncthreads();
    if (threadIdx.x == 0)
        __threadfence_system(); /* the staged words, before the network reads them */
    __syncthreads();
    nvshmemx_putmem_signal_nbi_block(
        s.sym + table, stage, (size_t)(E + 1) * 8,
        reinterpret_cast<uint64_t *>(s.sym + epx_ll_flag_offset(s, EPX_LL_KIND_DISPATCH, c.slot, c.me)),
        c.seq, NVSHMEM_SIGNAL_SET, r);
}

/*
 * Sources [0, n) reached by puts: wait for the signal that follows their count words
 * (publish_counts), so that their words are read whole. A source that stays silent is
 * masked here (and then skipped by the word reads). Every thread of the block calls it.
 */
__device__ void wait_put_counts(const epx_ll_shape_t &s, int slot, uint64_t seq, int n)
{
    if (!s.use_puts)
        return;
    for (int src = threadIdx.x; src < n; src += blockDim.x)
        if (s.peer[src] == NULL && !*reinterpret_cast<volatile int32_t *>(s.mask + src))
            (void)epx_ll_wait(epx_ll_own_flag(s, EPX_LL_KIND_DISPATCH, slot, src), seq, s.mask,
                              s.world, src, s.fail, s.timeout_ns, EPX_LL_STAGE_DISPATCH_COUNTS);
    __syncthreads();
}

/*
 * Step 5's puts, by the last block: for each (expert e, put receiver) with rows, the
 * staged rows [put_first[e], + hist[e]) go to the receiver's packed rows from base[e]:
 * rows, scales and source tokens, then (after nvshmem_fence, which orders them before
 * it) the top-k positions with a signal that adds 1 to the receiver's arrival counter.
 */
__device__ void put_batches(const epx_ll_shape_t &s, const send_ctx_t &c, const send_smem_t &m)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    (void)lane;
    const size_t scale_bytes = (size_t)c.scale_words * sizeof(float);
    for (int e = warp; e < c.E; e += EPX_LL_WARPS) {
        const int r = e / c.L, n = m.hist[e];
        if (n == 0 || !m.ok[r] || s.peer[r] != NULL)
            continue;
        const size_t q = (size_t)m.put_first[e];
        const size_t row = (size_t)(e % c.L) * (size_t)s.rows + (size_t)m.base[e];
        char *own = c.own; /* this rank's slot: the same offsets at the receiver */
        nvshmemx_putmem_nbi_warp(own + s.recv_x + row * c.row_bytes, own + s.put_x + q * c.row_bytes,
                                 (size_t)n * c.row_bytes, r);
        if (c.fp8)
            nvshmemx_putmem_nbi_warp(own + s.recv_scales + row * scale_bytes,
                                     own + s.put_scales + q * scale_bytes, (size_t)n * scale_bytes, r);
        nvshmemx_putmem_nbi_warp(own + s.recv_src_info + row * 4, own + s.put_src + q * 4,
                                 (size_t)n * 4, r);
        nvshmem_fence();
        nvshmemx_putmem_signal_nbi_warp(
            own + s.recv_topk + row * 4, own + s.put_topk + q * 4, (size_t)n * 4,
            reinterpret_cast<uint64_t *>(own + s.arrival) + c.me, 1, NVSHMEM_SIGNAL_ADD, r);
    }
}

__device__ void dispatch_send(const epx_ll_shape_t &s, const epx_ll_op_t &op, uint64_t seq)
{
    extern __shared__ __align__(16) char smem[];
    __shared__ int last;
    send_ctx_t c;
    c.R = s.world;
    c.me = s.rank;
    c.k = s.topk;
    c.L = s.num_local;
    c.E = s.num_experts;
    c.C = epx_ll2_chunk_tokens(c.k);
    c.slot = op.slot;
    c.T = op.tokens;
    c.cached = c.T * c.k <= EPX_LL2_CACHED_ENTRIES;
    c.fp8 = op.use_fp8;
    c.ue8m0 = op.use_ue8m0;
    c.tag = (uint32_t)seq;
    c.seq = seq;
    c.slot_base = s.slot[c.slot];
    c.own = s.sym + c.slot_base;
    c.row_bytes = c.fp8 ? (size_t)s.hidden : (size_t)s.hidden * 2;
    c.scale_words = !c.fp8 ? 0 : (c.ue8m0 ? s.hidden / EPX__UE8M0_GROUP : s.scale_cols);
    const int64_t per = (c.T + gridDim.x - 1) / gridDim.x;
    c.t0 = min(c.T, (int64_t)blockIdx.x * per);
    c.t1 = min(c.T, c.t0 + per);
    const send_smem_t m = send_smem(smem, c.E, c.k, c.R);
    const int R = c.R, k = c.k, L = c.L, E = c.E, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_START);

    /* The block's first rows into L2 while the handshakes below run. */
    {
        const char *x = reinterpret_cast<const char *>(op.x);
        const int64_t first = min((int64_t)c.C, c.t1 - c.t0), line_count = (s.hidden * 2 + 127) / 128;
        for (int64_t i = threadIdx.x; i < first * line_count; i += blockDim.x)
            epx_ll2_prefetch_l2(x + (size_t)(c.t0 + i / line_count) * op.x_stride * 2 +
                                (size_t)(i % line_count) * 128);
    }
    /* The routing, each entry once: the ids (out of range: -1, and recorded), then
     * duplicates of earlier positions -1 (the first position naming an expert is never
     * changed, so reading a neighbour while it is being cleared finds the same answer).
     * Without the cache, block 0 records ids out of range in step 2's pass. */
    if (c.cached) {
        for (int64_t i = threadIdx.x; i < c.T * k; i += blockDim.x)
            m.cache[i] = epx_ll_expert_or_none(s, EPX_LL_STAGE_DISPATCH, i,
                                               op.topk_idx[(i / k) * op.idx_stride + i % k]);
    }
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        m.hist[i] = 0;
        m.before[i] = 0;
        m.base[i] = 0;
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        m.rows_block[r] = 0;
        m.rows_to[r] = 0;
        m.batches_to[r] = 0;
    }
    __syncthreads();
    if (c.cached) {
        for (int64_t i = threadIdx.x; i < c.T * k; i += blockDim.x) {
            const int32_t e = m.cache[i];
            const int j = (int)(i % k);
            if (e < 0)
                continue;
            for (int p = 1; p <= j; p++)
                if (m.cache[i - p] == e) {
                    m.cache[i] = -1;
                    break;
                }
        }
    }

    if (s.trace != NULL) { /* uniform in the block */
        __syncthreads();
        epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_ROUTED);
    }

    /* 1. Release handshake: a step without a combine is given back here (as kernels 1);
     * a combined one was given back by its combine (ll2_device.cuh, "slot releases"). */
    if (blockIdx.x == 0)
        epx_ll_give_back(s, c.slot, seq - 1);
    epx_ll2_wait_released(s, c.slot, seq, m.ok);
    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_RELEASED);

    /* 2. Counts: all tokens, and those before this block's range. */
    for (int64_t i = threadIdx.x; i < c.T * k; i += blockDim.x) {
        const int e = entry_expert(s, op, m.cache, c.cached, i / k, (int)(i % k), k, blockIdx.x == 0);
        if (e < 0)
            continue;
        atomicAdd(&m.hist[e], 1);
        if (i / k < c.t0)
            atomicAdd(&m.before[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (m.hist[e] > 0) {
            atomicAdd(&m.rows_to[e / L], m.hist[e]);
            atomicAdd(&m.batches_to[e / L], 1);
        }
    }
    if (s.use_puts && warp == 0) {
        /* Each expert's rows for puts start after the earlier experts' (all experts: the
         * staging holds every row this rank may send, M * k). */
        for (int e = lane; e < E; e += 32)
            m.put_first[e] = m.hist[e];
        __syncwarp();
        epx_ll2_warp_scan(m.put_first, E, lane);
    }
    __syncthreads();
    for (int r = blockIdx.x; r < R; r += gridDim.x)
        if (m.ok[r])
            publish_counts(s, c, m, r);
    if (blockIdx.x == 0) {
        int32_t *sent_rows = reinterpret_cast<int32_t *>(s.local[c.slot] + s.sent_rows);
        for (int r = threadIdx.x; r < R; r += blockDim.x)
            sent_rows[r] = m.ok[r] ? m.rows_to[r] : 0;
    }

    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_PUBLISHED);
    /* 3. base[e]: the lower ranks' counts, each (rank, expert) word loaded by one thread,
     * four loads in flight before any is checked. A masked rank counts for nothing. */
    wait_put_counts(s, c.slot, seq, c.me);
    {
        const uint64_t *table = reinterpret_cast<const uint64_t *>(c.own + s.counts);
        const int pairs = c.me * E;
        for (int p0 = threadIdx.x; p0 < pairs; p0 += 4 * blockDim.x) {
            uint64_t v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int p = p0 + u * (int)blockDim.x;
                v[u] = p < pairs ? epx_ll2_ld_relaxed_sys(table + (size_t)(p / E) * (E + 1) + p % E) : 0;
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int p = p0 + u * (int)blockDim.x;
                if (p >= pairs)
                    break;
                const int src = p / E;
                if (*reinterpret_cast<volatile int32_t *>(s.mask + src))
                    continue;
                const int64_t count = epx_ll2_tag_value(s, table + (size_t)src * (E + 1) + p % E, v[u],
                                                        c.tag, src, EPX_LL_STAGE_DISPATCH_COUNTS);
                if (count > 0)
                    atomicAdd(&m.base[p % E], (int32_t)count);
            }
        }
    }
    __syncthreads();
    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_BASE);

    /* 4. Chunks of the block's tokens. */
    int32_t *send_pos = reinterpret_cast<int32_t *>(s.local[c.slot] + s.send_pos);
    for (int64_t c0 = c.t0; c0 < c.t1; c0 += c.C) {
        const int n = (int)min((int64_t)c.C, c.t1 - c0);
        for (int i = threadIdx.x; i < n * k; i += blockDim.x)
            m.chunk_expert[i] = entry_expert(s, op, m.cache, c.cached, c0 + i / k, i % k, k, 0);
        __syncthreads();
        /* Rows in token order: one warp walks the tokens (a token's experts are distinct). */
        if (warp == 0) {
            for (int tt = 0; tt < n; tt++) {
                for (int j = lane; j < k; j += 32) {
                    const int e = m.chunk_expert[tt * k + j];
                    if (e >= 0)
                        m.chunk_row[tt * k + j] = atomicAdd(&m.before[e], 1);
                }
                __syncwarp();
            }
        }
        __syncthreads();
        /* Each entry's destination once; the header (source token, top-k position) goes
         * now, and the packed row is kept for combine. */
        for (int i = threadIdx.x; i < n * k; i += blockDim.x) {
            const int e = m.chunk_expert[i];
            const int64_t t = c0 + i / k;
            const int j = i % k;
            m.dst_row[i] = NULL;
            m.dst_scales[i] = NULL;
            if (e < 0) {
                send_pos[t * k + j] = -1;
                continue;
            }
            const int32_t place = m.base[e] + m.chunk_row[i]; /* packed row within expert e */
            send_pos[t * k + j] = place;
            const int r = e / L;
            if (!m.ok[r])
                continue;
            char *peer = s.peer[r];
            if (peer != NULL) {
                char *d = peer + c.slot_base;
                const size_t row = (size_t)(e % L) * (size_t)s.rows + (size_t)place;
                m.dst_row[i] = d + s.recv_x + row * c.row_bytes;
                m.dst_scales[i] = d + s.recv_scales + row * (size_t)c.scale_words * 4;
                reinterpret_cast<int32_t *>(d + s.recv_src_info)[row] = (int32_t)t;
                reinterpret_cast<int32_t *>(d + s.recv_topk)[row] = j;
                atomicAdd(&m.rows_block[r], 1);
            } else {
                const size_t q = (size_t)(m.put_first[e] + m.chunk_row[i]);
                m.dst_row[i] = c.own + s.put_x + q * c.row_bytes;
                m.dst_scales[i] = c.own + s.put_scales + q * (size_t)c.scale_words * 4;
                reinterpret_cast<int32_t *>(c.own + s.put_src)[q] = (int32_t)t;
                reinterpret_cast<int32_t *>(c.own + s.put_topk)[q] = j;
            }
        }
        __syncthreads();
        if (c.fp8)
            send_items<true>(s, op, c, m, c0, n);
        else
            send_items<false>(s, op, c, m, c0, n);
        __syncthreads();
    }

    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_STORED);
    /* 5. This block's rows to each direct receiver are there (ll2_device.cuh: the barrier
     * above, then a release reduction, cumulative over the block's stores). */
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        char *peer = s.peer[r];
        if (m.ok[r] && peer != NULL && m.rows_block[r] > 0)
            epx_ll2_red_release_sys(
                reinterpret_cast<uint64_t *>(peer + c.slot_base + s.arrival) + c.me,
                (uint64_t)m.rows_block[r]);
    }
    if (!epx_last_block_reader(s.arrive + c.slot * 4 + EPX_LL_ARRIVE_DISPATCH_SEND, &last)) {
        epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_SENT);
        return;
    }
    /* Every block has read the sequence number (each counted above after reading it). */
    if (threadIdx.x == 0)
        s.seq[c.slot * 2] = seq;
    if (s.use_puts) {
        if (threadIdx.x == 0)
            __threadfence_system(); /* every block's staging, before the network reads it */
        __syncthreads();
        put_batches(s, c, m);
    }
    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, c.slot, seq, EPX_LL_TR_D_SENT);
}

/* The receive part's shared memory (int32, from the start). */
struct recv_smem_t {
    int32_t *count; /* [L][R] rows source s sends local expert e */
    int32_t *first; /* [L][R + 1] packed row where source s's rows start; [R]: the total */
    int32_t *rows_before; /* [L + 1] rows of the experts before e (over the grid's rows) */
    int32_t *units;  /* [R] arrival units each source announced */
    int32_t *failed; /* [R] masked, or its words never came */
};

/*
 * wait_recv_cost_stats (op.wait_stats): each thread takes sources src = threadIdx.x,
 * + blockDim.x, ... and waits for each one's data as a whole (a put source's signal, its
 * units word, then its arrival counter at those units), then adds the global timer's ns
 * since `start` to wait_stats[src]: one thread a source and one block in stream order, so
 * a plain add. Timing each source on its own is the point: the receive below reads every
 * source's counts before it waits for any rows, so there a late source would hold every
 * later wait up and look like all of them. The receive then finds everything there; a
 * source that is masked, or that this pass masks (timeout), adds nothing and counts as
 * failed below. Only with the stats: without, nothing waits before the counts.
 */
__device__ void time_sources(const epx_ll_shape_t &s, const epx_ll_op_t &op, uint64_t seq,
                             uint64_t start)
{
    const int R = s.world, E = s.num_experts, slot = op.slot;
    const uint32_t tag = (uint32_t)seq;
    const char *sym = s.sym + s.slot[slot];
    const uint64_t *table = reinterpret_cast<const uint64_t *>(sym + s.counts);
    const uint64_t *arrival = reinterpret_cast<const uint64_t *>(sym + s.arrival);
    for (int src = threadIdx.x; src < R; src += blockDim.x) {
        if (*reinterpret_cast<volatile int32_t *>(s.mask + src))
            continue;
        /* As wait_put_counts: the words of a put source are whole after its signal. */
        if (s.use_puts && s.peer[src] == NULL &&
            !epx_ll_wait(epx_ll_own_flag(s, EPX_LL_KIND_DISPATCH, slot, src), seq, s.mask, R, src,
                         s.fail, s.timeout_ns, EPX_LL_STAGE_DISPATCH_COUNTS))
            continue;
        const uint64_t *word = table + (size_t)src * (E + 1) + E; /* its units */
        const int64_t units = epx_ll2_tag_value(s, word, epx_ll2_ld_relaxed_sys(word), tag, src,
                                                EPX_LL_STAGE_DISPATCH_COUNTS);
        if (units < 0)
            continue;
        const uint64_t target = s.arrived[slot * R + src] + (uint64_t)(uint32_t)units;
        if (epx_ll2_wait_count(s, arrival + src, target, src, EPX_LL_STAGE_DISPATCH))
            op.wait_stats[src] += (int64_t)(epx_globaltimer() - start);
    }
}

/*
 * The receive: counts of every source for this rank's experts, the bookkeeping, then the
 * arrival of every source's rows. Every thread of one block runs it; `start`: the global
 * timer at the launch's start (wait_recv_cost_stats).
 */
__device__ void dispatch_recv(const epx_ll_shape_t &s, const epx_ll_op_t &op, uint64_t seq,
                              uint64_t start)
{
    extern __shared__ __align__(16) char smem[];
    const int R = s.world, L = s.num_local, E = s.num_experts, me = s.rank, slot = op.slot;
    recv_smem_t m;
    m.count = reinterpret_cast<int32_t *>(smem);
    m.first = m.count + L * R;
    m.rows_before = m.first + L * (R + 1);
    m.units = m.rows_before + L + 1;
    m.failed = m.units + R;
    const uint32_t tag = (uint32_t)seq;
    char *sym = s.sym + s.slot[slot];
    char *out = s.local[slot];
    const uint64_t *table = reinterpret_cast<const uint64_t *>(sym + s.counts);

    if (op.wait_stats != NULL) /* uniform in the block */
        time_sources(s, op, seq, start);
    wait_put_counts(s, slot, seq, R);
    for (int src = threadIdx.x; src < R; src += blockDim.x)
        m.failed[src] = *reinterpret_cast<volatile int32_t *>(s.mask + src);
    __syncthreads();
    /* Word q < L of source src is its count for local expert q; word L its units. */
    const int pairs = R * (L + 1);
    for (int p0 = threadIdx.x; p0 < pairs; p0 += 4 * blockDim.x) {
        uint64_t v[4];
        const uint64_t *w[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int p = p0 + u * (int)blockDim.x;
            const int src = p / (L + 1), q = p % (L + 1);
            w[u] = table + (size_t)src * (E + 1) + (q < L ? me * L + q : E);
            v[u] = p < pairs && !m.failed[src] ? epx_ll2_ld_relaxed_sys(w[u]) : 0;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int p = p0 + u * (int)blockDim.x;
            if (p >= pairs)
                break;
            const int src = p / (L + 1), q = p % (L + 1);
            int64_t value = 0;
            if (!m.failed[src]) {
                value = epx_ll2_tag_value(s, w[u], v[u], tag, src, EPX_LL_STAGE_DISPATCH_COUNTS);
                if (value < 0) {
                    m.failed[src] = 1;
                    value = 0;
                }
            }
            if (q < L)
                m.count[q * R + src] = (int32_t)value;
            else
                m.units[src] = (int32_t)value;
        }
    }
    __syncthreads();
    epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, slot, seq, EPX_LL_TR_D_COUNTS);
    /* Source order within each expert; a failed source has no rows. */
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        int32_t pos = 0;
        for (int src = 0; src < R; src++) {
            m.first[e * (R + 1) + src] = pos;
            pos += m.failed[src] ? 0 : m.count[e * R + src];
        }
        m.first[e * (R + 1) + R] = pos;
        m.rows_before[e] = pos;
    }
    __syncthreads();
    if ((threadIdx.x >> 5) == 0) {
        const int32_t total = epx_ll2_warp_scan(m.rows_before, L, threadIdx.x & 31);
        if (threadIdx.x == 0)
            m.rows_before[L] = total;
    }
    __syncthreads();
    int64_t *range = reinterpret_cast<int64_t *>(sym + s.recv_range);
    for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
        const int e = i / R, src = i % R;
        const int64_t begin = m.first[e * (R + 1) + src];
        const int64_t count = m.first[e * (R + 1) + src + 1] - begin;
        range[i] = (int64_t)(((uint64_t)begin << 32) | (uint64_t)count);
    }
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        const int32_t total = m.first[e * (R + 1) + R];
        reinterpret_cast<int32_t *>(out + s.recv_count)[e] = total;
        /* DeepEP's cumulative_local_expert_recv_stats (stream order: no atomics). */
        if (op.recv_stats != NULL)
            op.recv_stats[e] += total;
    }
    int32_t *src_rank = reinterpret_cast<int32_t *>(out + s.recv_src_rank);
    for (int g = threadIdx.x; g < m.rows_before[L]; g += blockDim.x) {
        const int e = epx_ll_find(m.rows_before, L, g);
        const int i = g - m.rows_before[e];
        src_rank[(int64_t)e * s.rows + i] = epx_ll_find(m.first + e * (R + 1), R, i);
    }
    if (s.trace != NULL) { /* uniform in the block */
        __syncthreads();
        epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, slot, seq, EPX_LL_TR_D_BOOKED);
    }
    /* Every source's rows: its arrival counter at what it announced (the acquire in the
     * wait makes the rows it counted visible; ll2_device.cuh). */
    const uint64_t *arrival = reinterpret_cast<const uint64_t *>(sym + s.arrival);
    for (int src = threadIdx.x; src < R; src += blockDim.x) {
        if (m.failed[src])
            continue;
        const uint64_t target = s.arrived[slot * R + src] + (uint64_t)(uint32_t)m.units[src];
        if (epx_ll2_wait_count(s, arrival + src, target, src, EPX_LL_STAGE_DISPATCH))
            s.arrived[slot * R + src] = target;
    }
    if (s.trace != NULL) { /* uniform in the block */
        __syncthreads();
        epx_ll2_trace(s, EPX_LL_TRACE_DISPATCH, slot, seq, EPX_LL_TR_D_ARRIVED);
    }
}

} // namespace

/*
 * The one kernel of a kernels-2 dispatch: the send, the receive, or both (a call without
 * EPX_LL_SEND_ONLY: block 0 receives after its share of the send). Its name keeps
 * "dispatch" for profilers and DeepEP's tests.
 */
namespace epx {
namespace ll2 {
__global__ void __launch_bounds__(EPX_LL_THREADS) dispatch(epx_ll_shape_t s, epx_ll_op_t op, int run)
{
    /* Launched early (epx_launch_early): the kernel before it on the stream ends first. */
    epx_wait_previous();
    /* wait_recv_cost_stats count from the start of the launch that receives: a call
     * without EPX_LL_SEND_ONLY is one launch, whose send already waits for the lower
     * ranks' counts (step 3), and that wait is theirs too. */
    const uint64_t start = op.wait_stats != NULL ? epx_globaltimer() : 0;
    if (run & EPX_LL_RUN_SEND) {
        /* Read by every block before it counts itself done; the last block advances it. */
        const uint64_t seq = epx_ll_seq(s, op.slot, 0) + 1;
        dispatch_send(s, op, seq);
        if ((run & EPX_LL_RUN_RECV) && blockIdx.x == 0) {
            __syncthreads();
            dispatch_recv(s, op, seq, start);
        }
    } else {
        dispatch_recv(s, op, epx_ll_seq(s, op.slot, 0), start);
    }
    /* Past its last wait: the next kernel may be placed (ll2_device.cuh, "Launched early"). */
    epx_let_next_start();
}
} // namespace ll2
} // namespace epx

extern "C" int epx_ll2_launch_dispatch(const epx_ll_shape_t *s, const epx_ll_op_t *op, int run,
                                       void *stream)
{
    size_t smem = epx_ll2_dispatch_smem(s->num_experts, s->topk, s->world, run);
    int blocks = (run & EPX_LL_RUN_SEND) ? s->blocks : 1;
    return (int)epx_launch_early(epx::ll2::dispatch, dim3((unsigned)blocks), dim3(EPX_LL_THREADS),
                                 smem, (cudaStream_t)stream, *s, *op, run);
}
