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
 * 2. Combine (the SM budget, a warp per item): first, for each record forwarded in the
 *    dispatch, this node's partial sum (rows read from the ranks of this node in place),
 *    staged and put with a signal that adds one to a counter at the record's home rank;
 *    then, for each own token, this node's partial in registers plus the other nodes'
 *    partials (after waiting until each node's counter has all of them), in node order,
 *    written to out. The last block tells the ranks of this node it no longer reads their
 *    x, waits for theirs, and ends the operation.
 * Buffer use: partial sums go to [N][T] slots, sized for the worst case. With
 * EPX_XN_RING_TOKENS the slots are rings and step 2 is xn_ring_combine.cu's kernel.
 */
#include "ops/cuda/nvshmem/xn_reduce.cuh"

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
        slot->ready_region = a.x_region;
        slot->ready_stride = a.x_stride;
        slot->ready_rows = a.x_rows;
        epx_st_release_sys(&slot->ready_flag, seq); /* a release: covers the three above */
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
 * Reduce and finish in one kernel (the SM budget, a warp per item). Items, in order:
 * the records this rank forwarded in the dispatch (their partial sum over this node's
 * ranks, staged and put to the home rank with a signal), then this rank's own tokens
 * (this node's partial sum computed in registers, the other nodes' partials waited for,
 * all added in node order). Doing the records first means the partial sums other ranks
 * wait for leave early.
 */
__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_xn_combine_kernel(epx__cuda_shape_t s, epx__cuda_combine_args_t a)
{
    __shared__ const char *x_base[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_stride[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_rows[EPX_CUDA_MAX_RANKS];
    __shared__ const char *local_row[EPX_XN_WARPS][32];
    __shared__ const float *local_weights[EPX_XN_WARPS][32];
    __shared__ const char *remote_row[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ const float *remote_weights[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int32_t first_record[EPX_CUDA_MAX_RANKS + 1];
    __shared__ int last;

    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node;
    const int me = s.rank, my_node = epx_xn_node(s, me), first_local = my_node * P;
    const uint64_t seq = epx_op_seq(s);
    if (epx_failed(s))
        return;
    epx_xn_combine_sources(s, a, x_base, x_stride, x_rows, first_record);

    char *own = epx_xn_own(s);
    const int lane = epx_lane(), warp = epx_warp();
    const unsigned lanes_below = (1u << lane) - 1u;
    const int64_t first_warp = (int64_t)blockIdx.x * EPX_XN_WARPS + warp;
    const int64_t num_warps = (int64_t)gridDim.x * EPX_XN_WARPS;
    const int64_t records = first_record[N];
    uint64_t arrived = 0; /* bit n: all of node n's partial sums are known to be here */

    /* Records: each warp a contiguous run, so its partial sums for one home rank lie in
     * consecutive slots and leave as one put with one signal. */
    const int64_t per_warp = (records + num_warps - 1) / num_warps;
    const int64_t run_begin = min(first_warp * per_warp, records);
    const int64_t run_end = min(run_begin + per_warp, records);
    int failed = 0;
    for (int64_t step = 0; step < run_end - run_begin; step++) {
        /* Test mode takes the run last first. */
        const int64_t q = s.xn_test_delay_ns > 0 ? run_end - 1 - step : run_begin + step;
        int node = 0;
        while (q >= first_record[node + 1])
            node++;
        const int64_t j = q - first_record[node];
        const int32_t *rows = a.xn.fwd_rows + ((int64_t)node * s.max_tokens + j) * P;
        int n_local = epx_xn_local_sources(s, rows, x_base, x_stride, x_rows, local_row[warp],
                                           local_weights[warp]);
        __syncwarp();
        char *out = own + s.off_xn_partial_out +
                    ((int64_t)node * s.max_tokens + j) * s.xn_partial_pitch;
        epx_xn_partial_write(s, a, out, local_row[warp], local_weights[warp], n_local);
        __syncwarp();
    }
    /* The run's partial sums, one put per home rank it reaches. */
    for (int node = 0; node < N && run_end > run_begin && !failed; node++) {
        int64_t from = max(run_begin, (int64_t)first_record[node]);
        int64_t to = min(run_end, (int64_t)first_record[node + 1]);
        if (from >= to)
            continue;
        int home = epx_xn_partner(s, node);
        int ok = 1;
        if (lane == 0)
            ok = epx_wait_flag(s, &epx_slot(s, me, home)->xn_enter, seq,
                               EPX_CUDA_STAGE_COMBINE_ENTER, home);
        if (!__shfl_sync(0xffffffffu, ok, 0)) {
            failed = 1;
            break;
        }
        epx_xn_test_delay(s.xn_test_delay_ns, (uint64_t)from);
        __syncwarp();
        int64_t at = (from - first_record[node]) * s.xn_partial_pitch;
        nvshmemx_putmem_signal_nbi_warp(
            own + s.off_xn_partial_in + (int64_t)my_node * s.max_tokens * s.xn_partial_pitch + at,
            own + s.off_xn_partial_out + (int64_t)node * s.max_tokens * s.xn_partial_pitch + at,
            (size_t)((to - from) * s.xn_partial_pitch),
            epx_xn_slot_field(s, me, offsetof(epx__cuda_slot_t, xn_partials)),
            (uint64_t)(to - from), NVSHMEM_SIGNAL_ADD, home);
    }
    __syncwarp();

    /* Own tokens. */
    for (int64_t j = first_warp; j < a.num_tokens && !failed; j += num_warps) {
        int n_local = epx_xn_local_sources(s, a.send_row + j * R + first_local, x_base, x_stride,
                                           x_rows, local_row[warp], local_weights[warp]);

        /* Own token j: the other nodes' partial sums, in node order (lane = node). */
        int before = 0, n_remote = 0, ok = 1;
        for (int n0 = 0; n0 < N; n0 += 32) {
            int other = n0 + lane;
            int32_t pos = other < N && other != my_node ? a.xn.node_pos[j * N + other] : -1;
            if (pos >= 0 && !((arrived >> other) & 1u)) {
                int partner = epx_xn_partner(s, other);
                uint64_t target =
                    s.local->xn_partials_seen[other] + (uint64_t)a.xn.node_out[other];
                if (epx_wait_flag(s, &epx_slot(s, me, partner)->xn_partials, target,
                                  EPX_CUDA_STAGE_COMBINE_PARTIAL, partner))
                    arrived |= 1ull << other;
                else
                    ok = 0;
            }
            unsigned has = __ballot_sync(0xffffffffu, pos >= 0);
            if (pos >= 0) {
                int at = n_remote + __popc(has & lanes_below);
                const char *slot = own + s.off_xn_partial_in +
                                   ((int64_t)other * s.max_tokens + pos) * s.xn_partial_pitch;
                remote_row[warp][at] = slot;
                remote_weights[warp][at] = reinterpret_cast<const float *>(slot + s.hidden * 2);
            }
            before += __popc(__ballot_sync(0xffffffffu, pos >= 0 && other < my_node));
            n_remote += __popc(has);
        }
        if (!__all_sync(0xffffffffu, ok))
            break;
        /* Every lane learns which nodes are complete (each lane waited for its own). */
        for (int o = 16; o > 0; o >>= 1)
            arrived |= __shfl_xor_sync(0xffffffffu, arrived, o);
        __syncwarp();

        epx_xn_reduce_token(s, a, j, local_row[warp], local_weights[warp], n_local,
                            remote_row[warp], remote_weights[warp], before, n_remote);
        __syncwarp();
    }

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE], &last))
        return;
    if (threadIdx.x == 0)
        nvshmem_quiet(); /* the staged partial sums may be reused after this */
    if (!epx_failed(s))
        for (int i = threadIdx.x; i < N; i += blockDim.x)
            s.local->xn_partials_seen[i] += (uint64_t)a.xn.node_out[i];
    __syncthreads();
    epx_xn_finish_node(s, offsetof(epx__cuda_slot_t, done_flag), seq,
                       EPX_CUDA_STAGE_COMBINE_DONE);
}

extern "C" int epx_xn_launch_ring_combine(const epx__cuda_shape_t *shape,
                                          const epx__cuda_combine_args_t *args, void *stream);

extern "C" int epx_xn_launch_combine(const epx__cuda_shape_t *shape,
                                     const epx__cuda_combine_args_t *args, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    epx_xn_ready_kernel<<<1, 64, 0, st>>>(*shape, *args);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return (int)err;
    if (shape->xn_ring > 0)
        return epx_xn_launch_ring_combine(shape, args, stream); /* xn_ring_combine.cu */
    epx_xn_combine_kernel<<<args->num_blocks, EPX_CUDA_THREADS, 0, st>>>(*shape, *args);
    return (int)cudaGetLastError();
}
