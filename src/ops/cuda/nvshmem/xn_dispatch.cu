/*
 * Internode dispatch: the count exchange, then the send and the forward (two kernels on
 * the caller's stream). N nodes of P ranks; a rank's partner on node n is the rank there
 * with the same local index.
 *
 * What moves: a token crosses the network once per destination node other than its
 * own, as one record (x row, fp8 scales, top-k ids and weights, its row at each rank of
 * that node: epx__cuda_xn_record) put into its partner there, which forwards it over
 * NVLink to every rank of its node that receives it. Ranks of the sender's own node get
 * the row by direct stores. Every row lands where the single-node dispatch puts it
 * (source rank order, then token order), so the results are the same bits.
 *
 * 1. Count exchange (one block): each token's ordinal among this rank's tokens to every
 *    rank and to every node, then one message per rank (its counts to each rank, to each
 *    node, to that rank's experts, and its input status) put with a signal; waits for
 *    everyone's; derives the receive offsets as on one node, and the records it will
 *    send to and receive from each node.
 * 2. Send (the SM budget, a warp per contiguous run of tokens): loads each x row once
 *    and stores it to the ranks of its node and into one staged record per destination
 *    node; the run's records for a node lie in consecutive slots, so they leave as one
 *    NVSHMEM put-with-signal whose signal adds their count to a counter at the partner
 *    (data and arrival in one operation; no quiet per warp, one quiet at the end so the
 *    staging can be reused).
 * 3. Forward (the same kernel: each warp turns to records when no token is left): waits
 *    until a node's counter has all its records, then stores each record's row to the
 *    ranks of this node that receive it; the last block raises this rank's data flag at
 *    every rank of its node and waits for theirs, which ends the dispatch.
 * Buffer use: records go to [N][T] slots (T = max_tokens_per_rank), so the memory is
 * sized for the worst case and no credits flow back; a sender writes a partner's slots
 * only after the partner's count message for this operation arrived, i.e. after the
 * partner finished forwarding the previous dispatch. With EPX_XN_RING_TOKENS the slots
 * are rings and step 2-3 is xn_ring_dispatch.cu's kernel instead (credits, warp roles).
 */
#include "ops/cuda/nvshmem/xn_send.cuh"

/* ---------------------------------------------------------------- count exchange */

__global__ void __launch_bounds__(EPX_CUDA_NOTIFY_THREADS)
    epx_xn_notify_kernel(epx__cuda_shape_t s, epx__cuda_notify_args_t a)
{
    extern __shared__ int32_t expert_counts[]; /* [E] */
    __shared__ int32_t warp_totals[32 * EPX_CUDA_MAX_RANKS];
    __shared__ int32_t running[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t node_running[EPX_CUDA_MAX_RANKS];
    __shared__ int any_bad;
    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node, L = s.num_local_experts;
    const int me = s.rank, my_node = epx_xn_node(s, me);
    const int64_t cols = s.xn_count_cols;
    const uint64_t seq = epx_op_seq(s);
    const int parity = (int)(seq & 1u);
    if (epx_failed(s))
        return;

    if (threadIdx.x == 0)
        any_bad = 0;
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        expert_counts[i] = 0;
    for (int r = threadIdx.x; r < EPX_CUDA_MAX_RANKS; r += blockDim.x)
        running[r] = node_running[r] = 0;
    __syncthreads();
    /* Fresh: routed by topk_idx, or by the caller's is_token_in_rank (then the per-expert
     * counts are the caller's num_tokens_per_expert). */
    const int fresh = a.topk_idx != NULL || a.is_token_in_rank != NULL;
    if (fresh) {
        int bad = 0;
        epx_notify_scan(s, a, expert_counts, warp_totals, running, &bad);
        if (bad)
            any_bad = 1;
        if (a.topk_idx == NULL) {
            __syncthreads();
            for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
                expert_counts[i] = a.num_tokens_per_expert[i];
        }
        /* Records: a token's ordinal among this rank's tokens to each other node. Each
         * thread reads back the send_row entries it wrote itself in the scan. */
        for (int64_t first = 0; first < a.num_tokens; first += blockDim.x) {
            int64_t t = first + threadIdx.x;
            uint64_t nodes = 0;
            if (t < a.num_tokens)
                for (int r = 0; r < R; r++)
                    if (a.send_row[t * R + r] >= 0 && r / P != my_node)
                        nodes |= 1ull << (r / P);
            epx_scan_round(nodes, N, t < a.num_tokens ? a.xn.node_pos + t * N : NULL,
                           warp_totals, node_running);
        }
        __syncthreads();
    }

    /* One message per rank: [R] rank counts, [N] node counts, [L] that rank's expert
     * counts, status. Cached mode sends the status only (the counts are the handle's). */
    char *own = epx_xn_own(s);
    const int lane = epx_lane();
    for (int r = epx_warp(); r < R; r += (int)(blockDim.x >> 5)) {
        int32_t *msg = reinterpret_cast<int32_t *>(own + s.off_xn_counts_out) + r * cols;
        if (fresh) {
            for (int i = lane; i < R; i += 32)
                msg[i] = running[i];
            for (int i = lane; i < N; i += 32)
                msg[R + i] = node_running[i];
            for (int i = lane; i < L; i += 32)
                msg[R + N + i] = expert_counts[r * L + i];
        }
        if (lane == 0)
            msg[R + N + L] = any_bad;
        __syncwarp();
        int32_t *dst = reinterpret_cast<int32_t *>(own + s.off_xn_counts) +
                       ((int64_t)parity * R + me) * cols;
        nvshmemx_putmem_signal_nbi_warp(
            dst, msg, (size_t)cols * 4,
            epx_xn_slot_field(s, me, offsetof(epx__cuda_slot_t, count_flag) + parity * 8), seq,
            NVSHMEM_SIGNAL_SET, r);
    }

    for (int r = threadIdx.x; r < R; r += blockDim.x)
        epx_wait_flag(s, &epx_slot(s, me, r)->count_flag[parity], seq, EPX_CUDA_STAGE_NOTIFY, r);
    __syncthreads();
    const volatile int32_t *inbox =
        reinterpret_cast<const int32_t *>(own + s.off_xn_counts) + (int64_t)parity * R * cols;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int status = inbox[r * cols + R + N + L];
        if (status != 0 && r != me && !epx_failed(s))
            epx_record_failure(s, EPX_CUDA_FAIL_PEER_INPUT, EPX_CUDA_STAGE_NOTIFY, r, r, 0, 0, 0);
    }
    __syncthreads();
    if (epx_failed(s))
        return;

    if (fresh) {
        const int align = a.expert_alignment > 1 ? a.expert_alignment : 1;
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            int32_t base = 0;
            for (int src = 0; src < me; src++)
                base += inbox[src * cols + r];
            s.local->base[r] = base;
        }
        for (int l = threadIdx.x; l < L; l += blockDim.x) {
            int32_t count = 0;
            for (int src = 0; src < R; src++)
                count += inbox[src * cols + R + N + l];
            count = (count + align - 1) / align * align;
            a.recv_per_expert[l] = count;
            if (a.ticket != 0)
                s.mapped_recv_per_expert[l] = count;
        }
        if (a.ticket != 0)
            for (int i = threadIdx.x; i < R * R; i += blockDim.x)
                s.mapped_rank_counts[i] = inbox[(i / R) * cols + i % R];
        /* DeepEP's rank_prefix_matrix for the handle: [s][r] = tokens ranks 0..s sent to r. */
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            int32_t sum = 0;
            for (int src = 0; src < R; src++) {
                sum += inbox[src * cols + r];
                a.rank_prefix[src * R + r] = sum;
            }
        }
        for (int n = threadIdx.x; n < N; n += blockDim.x) {
            a.xn.node_out[n] = n == my_node ? 0 : node_running[n];
            a.xn.node_in[n] =
                n == my_node ? 0 : inbox[epx_xn_partner(s, n) * cols + R + my_node];
        }
        if (threadIdx.x == 0) {
            int32_t total = 0;
            for (int src = 0; src < R; src++)
                total += inbox[src * cols + me];
            *a.recv_count = total;
            s.mapped->num_recv = total;
        }
    } else if (a.ticket != 0) {
        for (int l = threadIdx.x; l < L; l += blockDim.x)
            s.mapped_recv_per_expert[l] = a.recv_per_expert[l];
        if (threadIdx.x == 0)
            s.mapped->num_recv = *a.recv_count;
    }
    __syncthreads();
    if (a.ticket != 0 && threadIdx.x == 0) {
        __threadfence_system();
        s.mapped->ticket = a.ticket;
    }
}

/* ---------------------------------------------------------------- send and forward */

template <int kUnroll>
__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_xn_dispatch_kernel(epx__cuda_shape_t s, epx__cuda_dispatch_args_t a)
{
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t bases[EPX_CUDA_MAX_RANKS];
    /* A token's destinations: ranks of this node (>= 0), or records for node n (-1 - n). */
    __shared__ int32_t dest[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ char *dest_x[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int32_t dest_row[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int32_t first_record[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int last;

    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node;
    const int K = s.num_topk, me = s.rank, my_node = epx_xn_node(s, me);
    if (!epx_dispatch_enter(s, peers, bases))
        return;
    epx_xn_first_records(a.xn.node_in, N, first_record);
    __syncthreads();

    char *own = epx_xn_own(s);
    const epx__cuda_xn_record_t rec = epx__cuda_xn_record(a.row_bytes, a.num_scales, K, P);
    const int lane = epx_lane(), warp = epx_warp();
    const int64_t first_warp = (int64_t)blockIdx.x * EPX_XN_WARPS + warp;
    const int64_t num_warps = (int64_t)gridDim.x * EPX_XN_WARPS;

    /* Each warp sends a contiguous run of tokens: its records for one node then take
     * consecutive slots there and leave as one put with one signal per node. */
    const int64_t per_warp = (a.num_tokens + num_warps - 1) / num_warps;
    const int64_t run_begin = min(first_warp * per_warp, a.num_tokens);
    const int64_t run_end = min(run_begin + per_warp, a.num_tokens);
    char *outbox = own + s.off_xn_outbox;
    for (int64_t step = 0; step < run_end - run_begin; step++) {
        /* Test mode sends the last tokens first. */
        const int64_t t = s.xn_test_delay_ns > 0 ? run_end - 1 - step : run_begin + step;
        /* Ordinals become rows (fresh) for every rank: records carry the remote ones. */
        epx_xn_token_rows(a, t, R, bases);
        __syncwarp();
        /* Destinations in a fixed order: this node's ranks, then other nodes' records. */
        int n = epx_xn_token_dests<false>(s, a, t, peers, outbox, s.max_tokens, rec.bytes,
                                          dest[warp], dest_row[warp], dest_x[warp]);
        __syncwarp();
        if (n == 0)
            continue;
        epx_xn_token_write<kUnroll>(s, a, rec, t, peers, dest[warp], dest_row[warp],
                                    dest_x[warp], n);
        __syncwarp();
    }
    /* The run's records for each node: consecutive slots from the run's first one. */
    for (int node = 0; node < N && run_end > run_begin; node++) {
        if (node == my_node)
            continue;
        int32_t first = INT32_MAX, count = 0;
        for (int64_t t = run_begin + lane; t < run_end; t += 32) {
            int32_t pos = a.xn.node_pos[t * N + node];
            if (pos >= 0) {
                first = min(first, pos);
                count++;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
            count += __shfl_xor_sync(0xffffffffu, count, o);
        }
        if (count == 0)
            continue;
        epx_xn_test_delay(s.xn_test_delay_ns, (uint64_t)run_begin * 64 + node);
        __syncwarp();
        int64_t at = (int64_t)first * rec.bytes;
        nvshmemx_putmem_signal_nbi_warp(
            own + s.off_xn_inbox + (int64_t)my_node * s.max_tokens * rec.bytes + at,
            own + s.off_xn_outbox + (int64_t)node * s.max_tokens * rec.bytes + at,
            (size_t)count * (size_t)rec.bytes,
            epx_xn_slot_field(s, me, offsetof(epx__cuda_slot_t, xn_records)), (uint64_t)count,
            NVSHMEM_SIGNAL_ADD, epx_xn_partner(s, node));
    }
    __syncwarp();

    /* Forward: the records of other nodes' partners, once each node's have all arrived. */
    const uint64_t seq = epx_op_seq(s);
    int ready_node = -1; /* the node whose records this warp knows have all arrived */
    int node = 0;

    for (int64_t q = first_warp; q < first_record[N]; q += num_warps) {
        node = 0;
        while (q >= first_record[node + 1])
            node++;
        if (node != ready_node) {
            int partner = epx_xn_partner(s, node);
            uint64_t target = s.local->xn_records_seen[node] + (uint64_t)a.xn.node_in[node];
            int ok = 1;
            if (lane == 0)
                ok = epx_wait_flag(s, &epx_slot(s, me, partner)->xn_records, target,
                                   EPX_CUDA_STAGE_FORWARD, partner);
            if (!__shfl_sync(0xffffffffu, ok, 0))
                break;
            ready_node = node;
        }
        int64_t j = q - first_record[node];
        const char *record = own + s.off_xn_inbox + ((int64_t)node * s.max_tokens + j) * rec.bytes;
        epx_xn_forward_record<kUnroll>(s, a, rec, record, node, j, peers, dest[warp],
                                       dest_row[warp], dest_x[warp]);
        __syncwarp();
    }

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH], &last))
        return;
    /* Every record of this rank is on its way; the staging may be reused after this. */
    if (threadIdx.x == 0)
        nvshmem_quiet();
    if (!epx_failed(s))
        for (int i = threadIdx.x; i < N; i += blockDim.x)
            s.local->xn_records_seen[i] += (uint64_t)a.xn.node_in[i];
    __syncthreads();
    epx_xn_finish_node(s, offsetof(epx__cuda_slot_t, data_flag), seq, EPX_CUDA_STAGE_DISPATCH);
}

/* ---------------------------------------------------------------- launchers */

extern "C" int epx_xn_launch_notify(const epx__cuda_shape_t *shape,
                                    const epx__cuda_notify_args_t *args, void *stream)
{
    size_t smem = (size_t)shape->num_experts * sizeof(int32_t);
    epx_xn_notify_kernel<<<1, EPX_CUDA_NOTIFY_THREADS, smem, (cudaStream_t)stream>>>(*shape,
                                                                                    *args);
    return (int)cudaGetLastError();
}

extern "C" int epx_xn_launch_ring_dispatch(const epx__cuda_shape_t *shape,
                                           const epx__cuda_dispatch_args_t *args, void *stream);

extern "C" int epx_xn_launch_dispatch(const epx__cuda_shape_t *shape,
                                      const epx__cuda_dispatch_args_t *args, void *stream)
{
    if (shape->xn_ring > 0)
        return epx_xn_launch_ring_dispatch(shape, args, stream); /* xn_ring_dispatch.cu */
    cudaStream_t st = (cudaStream_t)stream;
    epx_xn_dispatch_kernel<8><<<args->num_blocks, EPX_CUDA_THREADS, 0, st>>>(*shape, *args);
    return (int)cudaGetLastError();
}
