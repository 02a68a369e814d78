/*
 * Kernels 2 of the low-latency combine (EPX_LL_KERNELS=2; docs/LOW_LATENCY.md, "Kernels
 * 2"; src/ops/host/host_ll_combine.c is the oracle they match).
 *
 * What moves: out[t] = bf16(sum over j of w_j * y(t, e_j)), an fp32 fused multiply-add
 * per entry in top-k order (epx_bf16x8_fma). Each home rank pulls the expert outputs of its tokens where the expert
 * ranks wrote them (the zero-copy combine input [local expert][packed row]; the packed
 * row is what the kernels-2 dispatch placed the row at, kept in send_pos), except from
 * ranks reached only by NVSHMEM puts (other nodes, or EPX_LL_FORCE_PUTS): those push each
 * row into the home rank's combine staging [token][top-k position], one put-with-signal
 * per row adding 1 to the home rank's combine arrival counter for that expert rank.
 *
 * Send: wait until the home ranks ended the slot's previous combine where it must
 * (ll2_device.cuh, "slot releases": with done flags every combine but the first, inferred
 * only a second combine of the slot's dispatch), then
 *   - x already in the combine input, no pushes (the usual case): one block raises the
 *     "outputs ready" flags and gives the step's dispatch results back (inferred: the
 *     flags give them back to direct peers), nothing else
 *     (the host launches a single block for a send alone; in a launch that also
 *     receives, warp 0 of block 0 does it while the block's other warps load the
 *     receive's first routing batch);
 *   - otherwise the grid's warps copy x into the combine input (x elsewhere) and push the
 *     rows of homes reached by puts; the last block raises the flags of the pulling homes
 *     and gives the dispatch results back.
 * Receive (grid; each block a contiguous range of tokens, in batches of
 *   EPX_LL2_ROUTE_TOKENS): the batch's routing goes to shared memory first (row address
 *   and weight of each valid entry, in top-k order; the first batch's before the waits),
 *   then each warp sums (token, 256-channel chunk) units: EPX_LL_COMBINE_RECV=2 (the
 *   default) loads a unit's rows (up to 8, 16 bytes a lane) into registers before it sums
 *   them; 1 streams units through a ring of `stages` cp.async stages of up to 8 rows x 16
 *   bytes per lane, several units' loads in flight while one is summed. The last block (a
 *   GPU-scope counter) counts the pushed rows, tells the expert ranks their slot is free
 *   (done flags; inferred, nothing does: this rank's next dispatch into the slot) and
 *   advances the sequence number. With
 *   wait_recv_cost_stats, block 0 adds for each expert rank the time from the launch's
 *   start until that rank's wait ended (every block waits for every rank; one counts).
 * A call without EPX_LL_SEND_ONLY runs both in one launch (block 0 sends first; the last
 * block of the receive advances the sequence number).
 * Bounds: shared memory epx_ll2_combine_smem (ll_plugin.h; above 48 KB, set by prepare).
 */
#include <cuda_bf16.h>

#include "ops/cuda/nvshmem/ll2_device.cuh"

namespace {

/* Is x the combine input already (the zero-copy buffer of this slot)? Host and device. */
__host__ __device__ __forceinline__ int combine_in_place(const epx_ll_shape_t &s, const epx_ll_op_t &op)
{
    return reinterpret_cast<const char *>(op.x) == s.sym + s.slot[op.slot] + s.combine_in;
}

/* Does the send move rows (copies of x into the combine input, or pushes by puts)? */
__host__ __device__ __forceinline__ int combine_moves(const epx_ll_shape_t &s, const epx_ll_op_t &op)
{
    return s.use_puts || !combine_in_place(s, op);
}

/*
 * The send. Called by every block of the launch; blocks other than 0 return at once
 * when no row moves. Updates the sequence number unless `fused` (then the receive does).
 */
__device__ void combine_send(const epx_ll_shape_t &s, const epx_ll_op_t &op, uint64_t seq, int fused)
{
    extern __shared__ __align__(16) char smem[];
    __shared__ int last;
    const int R = s.world, L = s.num_local, k = s.topk, slot = op.slot;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int32_t *ok = reinterpret_cast<int32_t *>(smem);  /* [R] */
    int32_t *expert_first = ok + R;                   /* [L + 1] */
    const size_t slot_base = s.slot[slot], row_bytes = (size_t)s.hidden * 2;
    char *own = s.sym + slot_base;
    const char *x = reinterpret_cast<const char *>(op.x);
    const int in_place = combine_in_place(s, op), moves = combine_moves(s, op);
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_START);
    if (!moves && blockIdx.x != 0)
        return;
    /* Until the homes ended the slot's previous combine (ll2_device.cuh, "slot releases":
     * inferred, only a second combine of the slot's dispatch waits, after telling). */
    const int waits = epx_ll2_combine_waits(s, slot, seq);
    if (waits && blockIdx.x == 0)
        epx_ll2_tell_combined(s, slot, seq - 1, (int)threadIdx.x, (int)blockDim.x);
    epx_ll_wait_peers(s, EPX_LL_KIND_COMBINE_DONE, slot, waits ? seq - 1 : 0,
                      EPX_LL_STAGE_COMBINE_RELEASE, ok);
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_RELEASED);

    if (!moves || in_place) {
        /* The outputs are in place already (written by earlier kernels of this stream):
         * the pulling homes may read them now. */
        if (blockIdx.x == 0) {
            /* A release store each, cumulative over the rows: no fence before it (a
             * system-scope fence here measured 12 us slower a step, docs/PERFORMANCE.md). */
            for (int r = threadIdx.x; r < R; r += blockDim.x)
                if (ok[r] && s.peer[r] != NULL)
                    epx_ll_signal(s, r, EPX_LL_KIND_COMBINE, slot, seq);
            epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_SIGNALLED);
        }
        if (!moves) {
            epx_ll2_give_back(s, slot, epx_ll_seq(s, slot, 0));
            if (!fused && threadIdx.x == 0)
                s.seq[slot * 2 + 1] = seq;
            return;
        }
    }

    /* Rows move: the grid's warps share every received row. */
    if (warp == 0) {
        const int32_t *recv_count = reinterpret_cast<const int32_t *>(s.local[slot] + s.recv_count);
        for (int e = lane; e < L; e += 32)
            expert_first[e] = recv_count[e];
        __syncwarp();
        const int32_t total = epx_ll2_warp_scan(expert_first, L, lane);
        if (lane == 0)
            expert_first[L] = total;
    }
    __syncthreads();
    const int warps = (int)gridDim.x * EPX_LL_WARPS;
    const int32_t *src_rank = reinterpret_cast<const int32_t *>(s.local[slot] + s.recv_src_rank);
    for (int g = (int)blockIdx.x * EPX_LL_WARPS + warp; g < expert_first[L]; g += warps) {
        const int e = epx_ll_find(expert_first, L, g);
        const int64_t row = (int64_t)e * s.rows + (g - expert_first[e]);
        const int home = src_rank[row];
        if (!ok[home])
            continue;
        char *stage = own + s.combine_in + (size_t)row * row_bytes;
        if (!in_place)
            epx_ll_warp_copy(stage, x + (size_t)row * row_bytes, row_bytes, lane);
        if (s.peer[home] != NULL)
            continue; /* pulled by the home rank */
        __syncwarp();
        const int64_t token = reinterpret_cast<const int32_t *>(own + s.recv_src_info)[row];
        const int64_t j = reinterpret_cast<const int32_t *>(own + s.recv_topk)[row];
        /* One message per row; its signal arrives after its data (NVSHMEM). */
        nvshmemx_putmem_signal_nbi_warp(own + s.combine_stage + (size_t)(token * k + j) * row_bytes,
                                        stage, row_bytes,
                                        reinterpret_cast<uint64_t *>(own + s.combine_arrival) + s.rank,
                                        1, NVSHMEM_SIGNAL_ADD, home);
    }
    /* The copies (system fences in epx_last_block: the pulling homes read them) and the
     * reads of this slot's dispatch results are done in every block. */
    if (!epx_last_block(s.arrive + slot * 4 + EPX_LL_ARRIVE_COMBINE_SEND, &last))
        return;
    if (!in_place) {
        for (int r = threadIdx.x; r < R; r += blockDim.x)
            if (ok[r] && s.peer[r] != NULL)
                epx_ll_signal(s, r, EPX_LL_KIND_COMBINE, slot, seq);
    }
    epx_ll2_give_back(s, slot, epx_ll_seq(s, slot, 0));
    if (!fused && threadIdx.x == 0)
        s.seq[slot * 2 + 1] = seq;
}

/* The receive's shared memory: copy stages, then one routing batch, then ok. */
struct recv_smem_t {
    int4 *stages;        /* [warps][stages][EPX_LL2_STAGE_ROWS][32] */
    uint64_t *row;       /* [TC * k] row address of each valid entry (compacted per token) */
    float *weight;       /* [TC * k] */
    int32_t *expert;     /* [TC * k] */
    int32_t *valid;      /* [TC] valid entries per token */
    int32_t *ok;         /* [R] */
};

__device__ __forceinline__ recv_smem_t recv_smem(char *smem, int k, int stages)
{
    const int tc = EPX_LL2_ROUTE_TOKENS;
    recv_smem_t m;
    m.stages = reinterpret_cast<int4 *>(smem);
    m.row = reinterpret_cast<uint64_t *>(smem + epx_ll2_combine_stage_bytes(stages));
    m.weight = reinterpret_cast<float *>(m.row + tc * k);
    m.expert = reinterpret_cast<int32_t *>(m.weight + tc * k);
    m.valid = m.expert + tc * k;
    m.ok = m.valid + tc;
    return m;
}

/* The block barrier (bar 0), or named barrier `bar` of `threads` threads. */
__device__ __forceinline__ void routing_sync(int bar, int threads)
{
    if (bar == 0)
        __syncthreads();
    else
        asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(threads) : "memory");
}

/*
 * Routing of tokens [b0, b0 + n): every entry's expert and weight, then its row address
 * (0 when it adds nothing: -1, or its rank masked now). A token sent one row per
 * distinct expert, at the first top-k position naming it. Run by the whole block, or by
 * `threads` threads numbered from `tid` = 0 that sync on named barrier `bar`.
 */
__device__ void load_routing(const epx_ll_shape_t &s, const epx_ll_op_t &op, const recv_smem_t &m,
                             int64_t b0, int n, int tid = (int)threadIdx.x,
                             int threads = (int)blockDim.x, int bar = 0)
{
    const int k = s.topk, L = s.num_local;
    const size_t row_bytes = (size_t)s.hidden * 2, slot_base = s.slot[op.slot];
    for (int i = tid; i < n * k; i += threads) {
        const int64_t t = b0 + i / k;
        const int j = i % k;
        m.expert[i] = epx_ll_expert_or_none(s, EPX_LL_STAGE_COMBINE, t * k + j,
                                            op.topk_idx[t * op.idx_stride + j]);
        m.weight[i] = op.weights[t * op.weight_stride + j];
    }
    routing_sync(bar, threads);
    const int32_t *send_pos = reinterpret_cast<const int32_t *>(s.local[op.slot] + s.send_pos);
    for (int i = tid; i < n * k; i += threads) {
        const int e = m.expert[i];
        m.row[i] = 0;
        if (e < 0)
            continue;
        const int r = e / L;
        if (*reinterpret_cast<volatile int32_t *>(s.mask + r))
            continue;
        const int j = i % k, token_begin = i - j;
        int first = 0;
        while (m.expert[token_begin + first] != e)
            first++;
        const int64_t t = b0 + i / k;
        const char *peer = s.peer[r];
        const char *row;
        if (peer != NULL) {
            /* The packed row the dispatch placed it at (never -1 for a first position,
             * unless the combine's routing differs from the dispatch's). */
            const int32_t place = send_pos[t * k + first];
            if (place < 0)
                continue;
            row = peer + slot_base + s.combine_in +
                  ((size_t)(e % L) * (size_t)s.rows + (size_t)place) * row_bytes;
        } else {
            row = s.sym + slot_base + s.combine_stage + (size_t)(t * k + first) * row_bytes;
        }
        m.row[i] = reinterpret_cast<uint64_t>(row);
    }
    routing_sync(bar, threads);
}

/* Compact each token's entries to the valid ones (their rank answered), in top-k order. */
__device__ void compact_routing(const epx_ll_shape_t &s, const recv_smem_t &m, int n)
{
    const int k = s.topk, L = s.num_local;
    for (int tt = threadIdx.x; tt < n; tt += blockDim.x) {
        int valid = 0;
        for (int j = 0; j < k; j++) {
            const int i = tt * k + j;
            const uint64_t row = m.row[i];
            if (row == 0 || !m.ok[m.expert[i] / L])
                continue;
            m.row[tt * k + valid] = row;
            m.weight[tt * k + valid] = m.weight[i];
            valid++;
        }
        m.valid[tt] = valid;
    }
    __syncthreads();
}

/*
 * One warp's share of a routing batch of n tokens from b0: units (token, 256-channel
 * chunk) warp, warp + warps, ...; each unit in groups of up to EPX_LL2_STAGE_ROWS rows,
 * each group one pipeline item (one stage of cp.async copies, 16 bytes of each row per
 * lane), `stages` items in flight.
 */
__device__ void reduce_batch(const epx_ll_shape_t &s, const epx_ll_op_t &op, const recv_smem_t &m,
                             int64_t b0, int n, int stages)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, k = s.topk;
    const int chunks = (int)((s.hidden + 255) / 256);
    const int groups = (k + EPX_LL2_STAGE_ROWS - 1) / EPX_LL2_STAGE_ROWS;
    const int units = n * chunks;
    const int my_units = warp < units ? (units - warp + EPX_LL_WARPS - 1) / EPX_LL_WARPS : 0;
    const int items = my_units * groups;
    int4 *ring = m.stages + (size_t)warp * stages * EPX_LL2_STAGE_ROWS * 32;

    /* Copies of item p into stage p % stages (a commit even when empty, so that the
     * group count stays in step with the items). */
    auto issue = [&](int p) {
        if (p < items) {
            const int unit = warp + (p / groups) * EPX_LL_WARPS, g = p % groups;
            const int tt = unit / chunks;
            const int64_t channel = (int64_t)(unit % chunks) * 256 + lane * 8;
            const int valid = m.valid[tt];
            int4 *slot = ring + (size_t)(p % stages) * EPX_LL2_STAGE_ROWS * 32 + lane;
            if (channel < s.hidden) {
                for (int b = 0; b < EPX_LL2_STAGE_ROWS; b++) {
                    const int jj = g * EPX_LL2_STAGE_ROWS + b;
                    if (jj >= valid)
                        break;
                    const char *row = reinterpret_cast<const char *>(m.row[tt * k + jj]);
                    epx_ll2_cp_async16(slot + b * 32, row + channel * 2);
                }
            }
        }
        epx_ll2_cp_async_commit();
    };

    for (int p = 0; p < stages - 1; p++)
        issue(p);
    float acc[8];
    for (int i = 0; i < 8; i++)
        acc[i] = 0.0f;
    for (int p = 0; p < items; p++) {
        issue(p + stages - 1);
        epx_ll2_cp_async_wait_pending(stages - 1); /* item p's copies are in */
        const int unit = warp + (p / groups) * EPX_LL_WARPS, g = p % groups;
        const int tt = unit / chunks;
        const int64_t channel = (int64_t)(unit % chunks) * 256 + lane * 8;
        const int valid = m.valid[tt];
        const int4 *slot = ring + (size_t)(p % stages) * EPX_LL2_STAGE_ROWS * 32 + lane;
        if (channel < s.hidden) {
            for (int b = 0; b < EPX_LL2_STAGE_ROWS; b++) {
                const int jj = g * EPX_LL2_STAGE_ROWS + b;
                if (jj >= valid)
                    break;
                epx_bf16x8_fma(acc, m.weight[tt * k + jj], slot[b * 32]);
            }
        }
        if (g == groups - 1) {
            if (channel < s.hidden) {
                int4 packed;
                __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(&packed);
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[i] = __float2bfloat16_rn(acc[i]);
                epx_st_v4(reinterpret_cast<char *>(op.out) +
                              ((size_t)(b0 + tt) * op.out_stride + channel) * 2,
                          packed);
            }
            for (int i = 0; i < 8; i++)
                acc[i] = 0.0f;
        }
    }
    epx_ll2_cp_async_wait<0>();
}

/*
 * The same reduction with loads into registers (EPX_LL_COMBINE_RECV=2, the default): each
 * warp takes one (token, 512-channel chunk) unit at a time, each lane 16 channels (two
 * 16-byte pieces of each row, 256 channels apart), and issues the loads of up to 8 of the
 * unit's rows (16 loads a lane, L2 only: the rows come from peers; one row address per row)
 * before it sums any. Same sums, in the same top-k order, as reduce_batch. Measured faster
 * than the copy stages, than 256-channel units (8 loads a lane in flight) and than two such
 * units a warp, docs/PERFORMANCE.md.
 */
__device__ void reduce_batch_loads(const epx_ll_shape_t &s, const epx_ll_op_t &op,
                                   const recv_smem_t &m, int64_t b0, int n)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, k = s.topk;
    const int chunks = (int)((s.hidden + 511) / 512);
    const int units = n * chunks;
    for (int u = warp; u < units; u += EPX_LL_WARPS) {
        const int entry = (u / chunks) * k; /* the token's first routing entry */
        const int c0 = (u % chunks) * 512 + lane * 8, c1 = c0 + 256;
        const bool has0 = c0 < s.hidden, has1 = c1 < s.hidden;
        const int valid = has0 ? m.valid[u / chunks] : 0;
        float acc0[8], acc1[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            acc0[i] = 0.0f;
            acc1[i] = 0.0f;
        }
        for (int g = 0; g < valid; g += 8) {
            int4 raw0[8], raw1[8];
#pragma unroll
            for (int b = 0; b < 8; b++) {
                if (g + b < valid) {
                    const int4 *row = reinterpret_cast<const int4 *>(m.row[entry + g + b]);
                    raw0[b] = __ldcg(row + c0 / 8);
                    if (has1)
                        raw1[b] = __ldcg(row + c1 / 8);
                }
            }
#pragma unroll
            for (int b = 0; b < 8; b++) {
                if (g + b >= valid)
                    break;
                const float w = m.weight[entry + g + b];
                epx_bf16x8_fma(acc0, w, raw0[b]);
                epx_bf16x8_fma(acc1, w, raw1[b]);
            }
        }
        const int64_t token = b0 + u / chunks;
        char *out = reinterpret_cast<char *>(op.out) + (size_t)token * op.out_stride * 2;
        int4 packed;
        __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(&packed);
        if (has0) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                o[i] = __float2bfloat16_rn(acc0[i]);
            epx_st_v4(out + (size_t)c0 * 2, packed);
        }
        if (has1) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                o[i] = __float2bfloat16_rn(acc1[i]);
            epx_st_v4(out + (size_t)c1 * 2, packed);
        }
    }
}

/*
 * EPX_LL_RELEASE 1, by the receive's last block: tell the expert ranks their slot is free
 * (COMBINE_DONE) and, when block 0's send left the give-back to the end (give_back: fused,
 * nothing moved), give the dispatch results back too, behind the same fence: one
 * system-scope fence for both flags, where a release store each costs a fence each (about
 * 4 us a fence here, docs/PERFORMANCE.md). ok: the expert ranks that answered.
 */
__device__ void tell_done(const epx_ll_shape_t &s, const int32_t *ok, int slot, uint64_t seq,
                          int give_back)
{
    const int R = s.world;
    const uint64_t give = give_back ? epx_ll_seq(s, slot, 0) : 0;
    const int giving = give != 0 && epx_ld_volatile_u64(s.released + slot) < give;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const int unmasked = !*reinterpret_cast<volatile int32_t *>(s.mask + r);
        char *peer = s.peer[r];
        if (peer == NULL) {
            if (ok[r])
                epx_ll_signal(s, r, EPX_LL_KIND_COMBINE_DONE, slot, seq);
            if (giving && unmasked)
                epx_ll_signal(s, r, EPX_LL_KIND_DISPATCH_DONE, slot, give);
            continue;
        }
        epx_fence_acq_rel_sys();
        if (ok[r])
            epx_ll2_st_relaxed_sys(reinterpret_cast<uint64_t *>(
                                       peer + epx_ll_flag_offset(s, EPX_LL_KIND_COMBINE_DONE, slot, s.rank)),
                                   seq);
        if (giving && unmasked)
            epx_ll2_st_relaxed_sys(reinterpret_cast<uint64_t *>(
                                       peer + epx_ll_flag_offset(s, EPX_LL_KIND_DISPATCH_DONE, slot, s.rank)),
                                   give);
    }
    if (giving) {
        __syncthreads();
        if (threadIdx.x == 0) {
            s.released[slot] = give;
            s.combined[slot] = give;
        }
    }
}

/* `start`: the global timer at the launch's start (wait_recv_cost_stats). */
template <int kLoads>
__device__ void combine_recv(const epx_ll_shape_t &s, const epx_ll_op_t &op, uint64_t seq, int fused,
                             int stages, uint64_t start, int routed = 0, int give_back = 0)
{
    extern __shared__ __align__(16) char smem[];
    __shared__ int last;
    const int R = s.world, k = s.topk, slot = op.slot;
    const int tc = EPX_LL2_ROUTE_TOKENS;
    const recv_smem_t m = recv_smem(smem, k, stages);
    const int64_t T = op.tokens, per = (T + gridDim.x - 1) / gridDim.x;
    const int64_t t0 = min(T, (int64_t)blockIdx.x * per), t1 = min(T, t0 + per);
    char *own = s.sym + s.slot[slot];
    /* wait_recv_cost_stats: block 0 alone times the waits, so each rank counts once. */
    const int timed = op.wait_stats != NULL && blockIdx.x == 0;

    if (!fused)
        epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_START);
    /* The first batch's routing before the waits (it needs only this rank's memory). */
    if (t0 < t1 && !routed)
        load_routing(s, op, m, t0, (int)min((int64_t)tc, t1 - t0));
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_ROUTED);
    /* Pulled ranks: their "outputs ready" flag; pushing ranks: the rows they push, as
     * many as this rank sent them in the dispatch, counted by their signals. */
    const int32_t *sent_rows = reinterpret_cast<const int32_t *>(s.local[slot] + s.sent_rows);
    const uint64_t *arrival = reinterpret_cast<const uint64_t *>(own + s.combine_arrival);
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int alive = !*reinterpret_cast<volatile int32_t *>(s.mask + r);
        if (alive && s.peer[r] != NULL)
            alive = epx_ll_wait(epx_ll_own_flag(s, EPX_LL_KIND_COMBINE, slot, r), seq, s.mask, R, r,
                                s.fail, s.timeout_ns, EPX_LL_STAGE_COMBINE);
        else if (alive)
            alive = epx_ll2_wait_count(s, arrival + r,
                                       s.combine_arrived[slot * R + r] + (uint64_t)sent_rows[r], r,
                                       EPX_LL_STAGE_COMBINE);
        m.ok[r] = alive;
        /* One thread a rank and one block in stream order: a plain add. */
        if (timed && alive)
            op.wait_stats[r] += (int64_t)(epx_globaltimer() - start);
    }
    __syncthreads();
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_READY);

    for (int64_t b0 = t0; b0 < t1; b0 += tc) {
        const int n = (int)min((int64_t)tc, t1 - b0);
        if (b0 != t0)
            load_routing(s, op, m, b0, n);
        compact_routing(s, m, n);
        if (kLoads == 2)
            reduce_batch_loads(s, op, m, b0, n);
        else
            reduce_batch(s, op, m, b0, n, stages);
        __syncthreads();
    }
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_REDUCED);

    if (!epx_last_block_reader(s.arrive + slot * 4 + EPX_LL_ARRIVE_COMBINE_RECV, &last))
        return;
    /* Every block is done reading the expert ranks' memory, and read the counters' bases
     * and the sequence number before counting itself: the rows pushed are counted. */
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (s.peer[r] == NULL && m.ok[r])
            s.combine_arrived[slot * R + r] += (uint64_t)sent_rows[r];
    /* Inferred, nothing is sent: the expert ranks learn that their slot is free from this
     * rank's next dispatch into it (ll2_device.cuh, "slot releases"); a give-back block 0's
     * send left to the end (give_back: fused, nothing moved) is recorded. */
    if (!epx_ll2_inferred(s))
        tell_done(s, m.ok, slot, seq, give_back);
    else if (give_back)
        epx_ll2_give_back(s, slot, epx_ll_seq(s, slot, 0));
    if (fused && threadIdx.x == 0)
        s.seq[slot * 2 + 1] = seq;
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_DONE);
}

/*
 * Block 0 of a combine that sends and receives in one launch with its rows in place
 * (nothing moves in the send): warp 0 waits for the release and raises the "outputs
 * ready" flags, while the other warps load the receive's first routing batch (named
 * barrier 1); then the block receives like every other. The send no longer delays block
 * 0's share of the sums (measured 5 us a step, docs/PERFORMANCE.md). The receive's last
 * block gives the dispatch results back (done flags: beside the expert ranks' "done" flags;
 * inferred: the outputs-ready flags did, it records that).
 */
template <int kLoads>
__device__ void combine_flags_and_recv(const epx_ll_shape_t &s, const epx_ll_op_t &op, uint64_t seq,
                                       int stages, uint64_t start)
{
    extern __shared__ __align__(16) char smem[];
    const int R = s.world, slot = op.slot;
    epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_START);
    if (threadIdx.x < 32) {
        /* The release wait, as the send's. */
        const int waits = epx_ll2_combine_waits(s, slot, seq);
        if (waits)
            epx_ll2_tell_combined(s, slot, seq - 1, (int)threadIdx.x, 32);
        /* Every wait, then every flag: the trace then tells the two apart. A peer that
         * timed out in its wait is masked there and gets no flag. */
        for (int r = threadIdx.x; r < R && waits; r += 32)
            if (!*reinterpret_cast<volatile int32_t *>(s.mask + r))
                (void)epx_ll_wait(epx_ll_own_flag(s, EPX_LL_KIND_COMBINE_DONE, slot, r), seq - 1,
                                  s.mask, R, r, s.fail, s.timeout_ns, EPX_LL_STAGE_COMBINE_RELEASE);
        __syncwarp();
        epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_RELEASED);
        for (int r = threadIdx.x; r < R; r += 32)
            if (!*reinterpret_cast<volatile int32_t *>(s.mask + r) && s.peer[r] != NULL)
                epx_ll_signal(s, r, EPX_LL_KIND_COMBINE, slot, seq);
        __syncwarp();
        epx_ll2_trace(s, EPX_LL_TRACE_COMBINE, slot, seq, EPX_LL_TR_C_SIGNALLED);
    } else {
        const int64_t T = op.tokens, first = min(T, (T + gridDim.x - 1) / gridDim.x);
        if (first > 0)
            load_routing(s, op, recv_smem(smem, s.topk, stages), 0,
                         (int)min((int64_t)EPX_LL2_ROUTE_TOKENS, first), (int)threadIdx.x - 32,
                         (int)blockDim.x - 32, 1);
    }
    __syncthreads();
    combine_recv<kLoads>(s, op, seq, 1, stages, start, 1, 1);
}

} // namespace

/*
 * The one kernel of a kernels-2 combine: the send, the receive, or both. Its name keeps
 * "combine" for profilers and DeepEP's tests.
 */
namespace epx {
namespace ll2 {
template <int kLoads>
__global__ void __launch_bounds__(EPX_LL_THREADS) combine(epx_ll_shape_t s, epx_ll_op_t op, int run,
                                                          int stages)
{
    /* Launched early (epx_launch_early): the kernel before it on the stream ends first. */
    epx_wait_previous();
    /* wait_recv_cost_stats count from the start of the launch that receives (a call
     * without EPX_LL_SEND_ONLY: the call's, as in the dispatch). */
    const uint64_t start = op.wait_stats != NULL ? epx_globaltimer() : 0;
    if (run & EPX_LL_RUN_SEND) {
        /* Read by every block before it counts itself done in the receive. */
        const uint64_t seq = epx_ll_seq(s, op.slot, 1) + 1;
        const int fused = (run & EPX_LL_RUN_RECV) != 0;
        const int moves = combine_moves(s, op);
        if (fused && !moves && blockIdx.x == 0) {
            combine_flags_and_recv<kLoads>(s, op, seq, stages, start);
        } else {
            combine_send(s, op, seq, fused);
            if (fused) {
                __syncthreads();
                combine_recv<kLoads>(s, op, seq, 1, stages, start, 0, !moves);
            }
        }
    } else {
        combine_recv<kLoads>(s, op, epx_ll_seq(s, op.slot, 1), 0, stages, start);
    }
    /* Past its last wait: the next kernel may be placed (ll2_device.cuh, "Launched early"). */
    epx_let_next_start();
}
} // namespace ll2
} // namespace epx

/*
 * The kernel for a receive's loads (shape.combine_recv, EPX_LL_COMBINE_RECV): 1 cp.async
 * stages, 2 registers. Each its own kernel, so that each gets its own register allocation.
 */
static void (*combine_kernel(int recv))(epx_ll_shape_t, epx_ll_op_t, int, int)
{
    return recv == 1 ? epx::ll2::combine<1> : epx::ll2::combine<2>;
}

/*
 * The combine receive's copy stages: none for loads into registers (combine_recv 2), else
 * as many (up to EPX_LL2_MAX_STAGES) as the device's shared memory per block holds beside
 * the kernel's static shared memory; and the attribute that lets the kernel use it
 * (process-wide: set to the most the device allows, so that no buffer's launch needs
 * more than another buffer set).
 */
extern "C" int epx_ll2_prepare(epx_ll_shape_t *s)
{
    int device = 0, optin = 0;
    cudaFuncAttributes attributes;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err == cudaSuccess)
        err = cudaFuncGetAttributes(&attributes, combine_kernel(s->combine_recv));
    if (err != cudaSuccess)
        return (int)err;
    const size_t dynamic = (size_t)optin - attributes.sharedSizeBytes;
    const int both = EPX_LL_RUN_SEND | EPX_LL_RUN_RECV;
    /* Loads into registers (EPX_LL_COMBINE_RECV 2): no stages. */
    s->stages = s->combine_recv == 2 ? 0 : EPX_LL2_MAX_STAGES;
    while (s->stages > 1 &&
           epx_ll2_combine_smem(s->num_experts, s->topk, s->world, s->stages, both) > dynamic)
        s->stages--;
    if (epx_ll2_combine_smem(s->num_experts, s->topk, s->world, s->stages, both) > dynamic)
        return (int)cudaErrorInvalidValue;
    return (int)cudaFuncSetAttribute(combine_kernel(s->combine_recv),
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dynamic);
}

extern "C" int epx_ll2_launch_combine(const epx_ll_shape_t *s, const epx_ll_op_t *op, int run,
                                      void *stream)
{
    size_t smem = epx_ll2_combine_smem(s->num_experts, s->topk, s->world, s->stages, run);
    /* A send alone that moves no row is one block's work (flags). */
    const int blocks = (run == EPX_LL_RUN_SEND && !combine_moves(*s, *op)) ? 1 : s->blocks;
    void (*kernel)(epx_ll_shape_t, epx_ll_op_t, int, int) = combine_kernel(s->combine_recv);
    return (int)epx_launch_early(kernel, dim3((unsigned)blocks), dim3(EPX_LL_THREADS), smem,
                                 (cudaStream_t)stream, *s, *op, run, s->stages);
}
