/*
 * Internode combine with rings (EPX_XN_RING_TOKENS = C > 0): the main kernel of
 * xn_combine.cu, with partial-sum slots [N][C] used as rings and credits flowing back
 * as the home ranks consume them (the protocol and why it always progresses:
 * xn_ring.cuh). The ready kernel is xn_combine.cu's; the order of additions is the same
 * (docs/INTERNODE.md), so are the bits.
 *
 * Roles (warps of each block, xn_ring.cuh): producers take the records this rank
 * forwarded in the dispatch strided (in node order, then record order), wait for the
 * credit of each, reduce it over this node's rows into the partial-sum ring for its home
 * rank, and put it with one put-with-signal once the home rank entered this combine;
 * reducers take this rank's own tokens (warp k: tokens k, k + count, ...),
 * wait for the chunks that hold their partial sums, add them in node order, and count
 * them consumed; the credit warp returns credits chunk by chunk, in order.
 * Buffer use: [N][C] partial-sum slots in and out per rank, whatever the routing.
 */
#include "ops/cuda/nvshmem/xn_reduce.cuh"
#include "ops/cuda/nvshmem/xn_ring.cuh"

/* Where this node's ranks published their x (the ready kernel), per local rank. */
typedef struct {
    const char *const *base;
    const int64_t *stride;
    const int64_t *rows;
} epx_xn_sources_t;

/* Producers: this warp's forwarded records (index, index + count, ... in node order). */
__device__ __forceinline__ void epx_xn_ring_produce(const epx__cuda_shape_t &s,
                                                    const epx__cuda_combine_args_t &a,
                                                    const epx_xn_role_t &role,
                                                    const epx_xn_sources_t &x,
                                                    const int32_t *first_record,
                                                    const char **local_row,
                                                    const float **local_weights)
{
    const int N = s.num_nodes, P = s.ranks_per_node;
    epx_xn_ring_put_t p;
    p.stage = epx_xn_own(s) + s.off_xn_partial_out;
    p.dst_offset = s.off_xn_partial_in;
    p.pitch = s.xn_partial_pitch;
    p.ring = epx_xn_ring(s, 1);
    p.credit_stage = EPX_CUDA_STAGE_COMBINE_CREDIT;
    p.enter_offset = (int64_t)offsetof(epx__cuda_slot_t, xn_enter);
    for (int64_t q = role.index; q < first_record[N]; q += role.count) {
        int node = 0;
        while (q >= first_record[node + 1])
            node++;
        const int64_t j = q - first_record[node];
        if (!epx_xn_ring_reserve(s, p, node, j))
            return;
        const int32_t *rows = a.xn.fwd_rows + ((int64_t)node * s.max_tokens + j) * P;
        int n_local = epx_xn_local_sources(s, rows, x.base, x.stride, x.rows, local_row,
                                           local_weights);
        __syncwarp();
        epx_xn_partial_write(s, a, epx_xn_ring_slot(s, p, node, j), local_row, local_weights,
                             n_local);
        __syncwarp();
        if (!epx_xn_ring_put(s, p, node, j))
            return;
        __syncwarp();
    }
}

/* Reducers: this warp's own tokens, each once all its partial sums landed. */
__device__ __forceinline__ void epx_xn_ring_reduce(const epx__cuda_shape_t &s,
                                                   const epx__cuda_combine_args_t &a,
                                                   const epx_xn_role_t &role,
                                                   const epx_xn_sources_t &x,
                                                   const char **local_row,
                                                   const float **local_weights,
                                                   const char **remote_row,
                                                   const float **remote_weights)
{
    const int R = s.world_size, N = s.num_nodes, P = s.ranks_per_node, lane = epx_lane();
    const int me = s.rank, my_node = epx_xn_node(s, me), first_local = my_node * P;
    const unsigned lanes_below = (1u << lane) - 1u;
    const int64_t C = s.xn_ring;
    const epx_xn_ring_t ring = epx_xn_ring(s, 1);
    const char *partial_in = epx_xn_own(s) + s.off_xn_partial_in;
    /* The chunk each lane knows has landed, for nodes lane and lane + 32. */
    int64_t known[2] = {-1, -1};

    for (int64_t j = role.index; j < a.num_tokens; j += role.count) {
        int n_local = epx_xn_local_sources(s, a.send_row + j * R + first_local, x.base,
                                           x.stride, x.rows, local_row, local_weights);
        /* The other nodes' partial sums, in node order (lane = node). */
        int before = 0, n_remote = 0, ok = 1;
        int32_t pos[2];
        for (int i = 0; i < 2; i++) {
            const int other = lane + 32 * i;
            pos[i] = other < N && other != my_node ? a.xn.node_pos[j * N + other] : -1;
            if (pos[i] >= 0 && pos[i] / s.xn_chunk != known[i]) {
                const int64_t chunk = pos[i] / s.xn_chunk;
                const int partner = epx_xn_partner(s, other);
                const uint64_t target = epx_xn_chunk_target(s, chunk, a.xn.node_out[other]);
                if (epx_wait_flag(s, ring.arrived + epx_xn_chunk_slot(s, other, pos[i]), target,
                                  EPX_CUDA_STAGE_COMBINE_PARTIAL, partner))
                    known[i] = chunk;
                else
                    ok = 0;
            }
            unsigned has = __ballot_sync(0xffffffffu, pos[i] >= 0);
            if (pos[i] >= 0) {
                int at = n_remote + __popc(has & lanes_below);
                const char *slot = partial_in +
                                   ((int64_t)other * C + (pos[i] & (C - 1))) * s.xn_partial_pitch;
                remote_row[at] = slot;
                remote_weights[at] = reinterpret_cast<const float *>(slot + s.hidden * 2);
            }
            before += __popc(__ballot_sync(0xffffffffu, pos[i] >= 0 && other < my_node));
            n_remote += __popc(has);
        }
        if (!__all_sync(0xffffffffu, ok))
            return;
        __syncwarp();
        epx_xn_reduce_token(s, a, j, local_row, local_weights, n_local, remote_row,
                            remote_weights, before, n_remote);
        /* Every lane's reads of the partial sums are done: count them consumed. */
        __threadfence();
        __syncwarp();
        for (int i = 0; i < 2; i++)
            if (pos[i] >= 0)
                atomicAdd(ring.done + epx_xn_chunk_slot(s, lane + 32 * i, pos[i]), 1u);
        __syncwarp();
    }
}

__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_xn_ring_combine_kernel(epx__cuda_shape_t s, epx__cuda_combine_args_t a)
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

    const int N = s.num_nodes;
    if (epx_failed(s))
        return;
    epx_xn_combine_sources(s, a, x_base, x_stride, x_rows, first_record);

    const epx_xn_sources_t x = {x_base, x_stride, x_rows};
    const epx_xn_role_t role = epx_xn_ring_role();
    const int warp = epx_warp();
    if (role.kind == EPX_XN_ROLE_SEND)
        epx_xn_ring_produce(s, a, role, x, first_record, local_row[warp], local_weights[warp]);
    else if (role.kind == EPX_XN_ROLE_RECEIVE)
        epx_xn_ring_reduce(s, a, role, x, local_row[warp], local_weights[warp],
                           remote_row[warp], remote_weights[warp]);
    else
        epx_xn_ring_credits(s, epx_xn_ring(s, 1), a.xn.node_out,
                            EPX_CUDA_STAGE_COMBINE_PARTIAL);
    __syncwarp();

    const uint64_t seq = epx_op_seq(s);
    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE], &last))
        return;
    if (threadIdx.x == 0)
        nvshmem_quiet(); /* the staged partial sums may be reused after this */
    if (!epx_failed(s)) {
        const epx_xn_ring_t ring = epx_xn_ring(s, 1);
        for (int i = threadIdx.x; i < N; i += blockDim.x)
            ring.sent[i] += (uint64_t)a.xn.node_in[i];
    }
    __syncthreads();
    epx_xn_finish_node(s, offsetof(epx__cuda_slot_t, done_flag), seq,
                       EPX_CUDA_STAGE_COMBINE_DONE);
}

extern "C" int epx_xn_launch_ring_combine(const epx__cuda_shape_t *shape,
                                          const epx__cuda_combine_args_t *args, void *stream)
{
    cudaStream_t st = (cudaStream_t)stream;
    epx_xn_ring_combine_kernel<<<args->num_blocks, EPX_CUDA_THREADS, 0, st>>>(*shape, *args);
    return (int)cudaGetLastError();
}
