/*
 * Internode dispatch with rings (EPX_XN_RING_TOKENS = C > 0): the send-and-forward
 * kernel of xn_dispatch.cu, with record slots [N][C] used as rings and credits flowing
 * back as they drain (the protocol and why it always progresses: xn_ring.cuh). The
 * count exchange is xn_dispatch.cu's; the results are the same bits (rows land where
 * the single-node dispatch puts them, whatever the arrival order).
 *
 * Roles (warps of each block, xn_ring.cuh): senders take tokens strided (so the records
 * the ring lets through at a time belong to many warps), wait for the credits of the
 * token's records, store its row to the ranks of this node and stage one record per
 * other node in the outbox ring, and put each record with one put-with-signal (one
 * network message per record, as the bench counts); forwarders each own
 * records of one or more channels (records j = k, k + step, ... of a channel) and poll
 * them without blocking, forwarding a record once its chunk has landed and counting it
 * consumed; the credit warp returns credits chunk by chunk, in order.
 * Buffer use: [N][C] record slots in and out per rank, whatever the routing.
 */
#include "ops/cuda/nvshmem/xn_ring.cuh"
#include "ops/cuda/nvshmem/xn_send.cuh"

/* Senders: this warp's tokens (index, index + count, ...), in order. */
template <int kUnroll>
__device__ __forceinline__ void epx_xn_ring_send(const epx__cuda_shape_t &s,
                                                 const epx__cuda_dispatch_args_t &a,
                                                 const epx__cuda_xn_record_t &rec,
                                                 const epx_xn_role_t &role, char *const *peers,
                                                 const int32_t *bases, int32_t *dest,
                                                 int32_t *dest_row, char **dest_x)
{
    const int R = s.world_size;
    epx_xn_ring_put_t p;
    p.stage = epx_xn_own(s) + s.off_xn_outbox;
    p.dst_offset = s.off_xn_inbox;
    p.pitch = rec.bytes;
    p.ring = epx_xn_ring(s, 0);
    p.credit_stage = EPX_CUDA_STAGE_CREDIT;
    p.enter_offset = -1;
    /* In order even in test mode: a later record may need the credits of earlier ones. */
    for (int64_t t = role.index; t < a.num_tokens; t += role.count) {
        epx_xn_token_rows(a, t, R, bases);
        __syncwarp();
        int n = epx_xn_token_dests<true>(s, a, t, peers, p.stage, s.xn_ring, rec.bytes, dest,
                                         dest_row, dest_x);
        __syncwarp();
        if (n == 0)
            continue;
        int ok = 1;
        for (int d = 0; d < n && ok; d++)
            if (dest[d] < 0)
                ok = epx_xn_ring_reserve(s, p, -1 - dest[d], dest_row[d]);
        if (!ok)
            return;
        epx_xn_token_write<kUnroll>(s, a, rec, t, peers, dest, dest_row, dest_x, n);
        __syncwarp();
        for (int d = 0; d < n; d++)
            if (dest[d] < 0)
                epx_xn_ring_put(s, p, -1 - dest[d], dest_row[d]);
        __syncwarp();
    }
}

/*
 * Forwarders: this warp's records. With at least as many forwarders as channels (other
 * nodes), each channel has its own warps and warp k of a channel's `step` takes records
 * k, k + step, ...; with fewer, a warp takes every record of channels index,
 * index + count, ... Lane i keeps owned channels i and i + 32 (cursor, known chunk)
 * and the warp forwards whichever have landed, never waiting on one channel while
 * another has work.
 */
template <int kUnroll>
__device__ __forceinline__ void epx_xn_ring_forward(const epx__cuda_shape_t &s,
                                                    const epx__cuda_dispatch_args_t &a,
                                                    const epx__cuda_xn_record_t &rec,
                                                    const epx_xn_role_t &role,
                                                    char *const *peers, int32_t *dest,
                                                    int32_t *dest_row, char **dest_x)
{
    const int N = s.num_nodes, my_node = epx_xn_node(s, s.rank), lane = epx_lane();
    const int64_t channels = N - 1, C = s.xn_ring;
    const epx_xn_ring_t ring = epx_xn_ring(s, 0);
    const char *inbox = epx_xn_own(s) + s.off_xn_inbox;
    int node[2];
    int64_t next[2], total[2], step[2], known[2];
    for (int i = 0; i < 2; i++) {
        int64_t channel = -1;
        step[i] = 1;
        next[i] = 0;
        if (role.count >= channels) {
            if (lane == 0 && i == 0) {
                channel = role.index % channels;
                next[i] = role.index / channels;
                step[i] = (role.count - 1 - channel) / channels + 1;
            }
        } else {
            channel = role.index + (int64_t)(lane + 32 * i) * role.count;
        }
        node[i] = channel >= 0 && channel < channels
                      ? (int)(channel < my_node ? channel : channel + 1)
                      : -1;
        total[i] = node[i] >= 0 ? a.xn.node_in[node[i]] : 0;
        known[i] = -1;
    }

    uint64_t since = epx_globaltimer();
    for (;;) {
        int ready[2], open = 0, peer = -1;
        for (int i = 0; i < 2; i++) {
            ready[i] = 0;
            if (next[i] >= total[i])
                continue;
            open = 1;
            peer = epx_xn_partner(s, node[i]);
            const int64_t chunk = next[i] / s.xn_chunk;
            if (chunk != known[i] && epx_xn_ring_arrived(s, ring, node[i], chunk, total[i]))
                known[i] = chunk;
            ready[i] = chunk == known[i];
        }
        const unsigned open_lanes = __ballot_sync(0xffffffffu, open);
        if (open_lanes == 0)
            return;
        int moved = 0;
        for (int i = 0; i < 2; i++) {
            unsigned lanes = __ballot_sync(0xffffffffu, ready[i]);
            while (lanes != 0) {
                const int owner = __ffs(lanes) - 1;
                lanes &= lanes - 1;
                const int from = __shfl_sync(0xffffffffu, node[i], owner);
                const int64_t j = __shfl_sync(0xffffffffu, next[i], owner);
                const char *record = inbox + ((int64_t)from * C + (j & (C - 1))) * rec.bytes;
                epx_xn_forward_record<kUnroll>(s, a, rec, record, from, j, peers, dest,
                                               dest_row, dest_x);
                epx_xn_ring_consumed(s, ring, from, j);
                if (lane == owner)
                    next[i] += step[i];
                moved = 1;
            }
        }
        if (moved) {
            since = epx_globaltimer();
            continue;
        }
        peer = __shfl_sync(0xffffffffu, peer, __ffs(open_lanes) - 1);
        if (epx_xn_ring_give_up(s, since, EPX_CUDA_STAGE_FORWARD, peer))
            return;
    }
}

template <int kUnroll>
__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_xn_ring_dispatch_kernel(epx__cuda_shape_t s, epx__cuda_dispatch_args_t a)
{
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t bases[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t dest[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ char *dest_x[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int32_t dest_row[EPX_XN_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    const int N = s.num_nodes;
    if (!epx_dispatch_enter(s, peers, bases))
        return;
    __syncthreads();

    const epx__cuda_xn_record_t rec =
        epx__cuda_xn_record(a.row_bytes, a.num_scales, s.num_topk, s.ranks_per_node);
    const epx_xn_role_t role = epx_xn_ring_role();
    const int warp = epx_warp();
    if (role.kind == EPX_XN_ROLE_SEND)
        epx_xn_ring_send<kUnroll>(s, a, rec, role, peers, bases, dest[warp], dest_row[warp],
                                  dest_x[warp]);
    else if (role.kind == EPX_XN_ROLE_RECEIVE)
        epx_xn_ring_forward<kUnroll>(s, a, rec, role, peers, dest[warp], dest_row[warp],
                                     dest_x[warp]);
    else
        epx_xn_ring_credits(s, epx_xn_ring(s, 0), a.xn.node_in, EPX_CUDA_STAGE_FORWARD);
    __syncwarp();

    const uint64_t seq = epx_op_seq(s);
    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH], &last))
        return;
    /* Every record of this rank is on its way; the staging may be reused after this. */
    if (threadIdx.x == 0)
        nvshmem_quiet();
    if (!epx_failed(s)) {
        const epx_xn_ring_t ring = epx_xn_ring(s, 0);
        for (int i = threadIdx.x; i < N; i += blockDim.x)
            ring.sent[i] += (uint64_t)a.xn.node_out[i];
    }
    __syncthreads();
    epx_xn_finish_node(s, offsetof(epx__cuda_slot_t, data_flag), seq, EPX_CUDA_STAGE_DISPATCH);
}

extern "C" int epx_xn_launch_ring_dispatch(const epx__cuda_shape_t *shape,
                                           const epx__cuda_dispatch_args_t *args, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    epx_xn_ring_dispatch_kernel<8><<<args->num_blocks, EPX_CUDA_THREADS, 0, st>>>(*shape, *args);
    return (int)cudaGetLastError();
}
