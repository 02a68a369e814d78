/*
 * Dispatch data kernel, bulk-copy form (EPX_NORMAL_KERNELS=2). What it moves, where rows
 * land, the fresh-mode row rewrite and the signals are those of dispatch.cu (read its
 * comment first); only how the bytes move differs.
 *
 * Roles: each block has EPX_BULK_PIPES warps and each warp runs its own ring of `stages`
 * row slots in shared memory over its tokens (grid-stride, one token per slot). Lane 0
 * drives the copies: one bulk load per row (x, and the fp8 scales when they are
 * contiguous) into a slot, then, once the slot's barrier says the row arrived, one bulk
 * store per destination rank straight into that rank's receive region (CUDA IPC
 * mapping), committed as one group. While a token's row is being stored, the loads of
 * the next stages-1 tokens are in flight: the ring keeps stages x row bytes per warp
 * moving, without holding a register per byte.
 *
 * Per-row bookkeeping stays off the copy's critical path: the whole warp reads a
 * token's destination rows (and rewrites them in fresh mode) when its load is issued,
 * stages-1 tokens ahead, with the routing loads themselves issued one iteration before
 * they are used; the top-k ids and weights are read one token ahead as well, and stored
 * to each destination by the lanes (with the scales when they are strided) while the
 * row's bulk stores run.
 *
 * Signals: as dispatch.cu, after every warp waited for its bulk stores to be performed
 * (and fenced them against the generic release of the data flag).
 *
 * Buffer use: as dispatch.cu. Shared memory: stages x (row + scales, rounded to 128
 * bytes, + the slot's routing) per warp, sized by the launcher (at most
 * EPX_BULK_RING_BYTES per block). Falls back to the vector kernel when x rows are not
 * 16-byte aligned or a ring of two rows does not fit.
 */
#include "bulk.cuh"
#include "dispatch_parts.cuh"
#include "signal.cuh"

/* A slot's routing: which ranks receive the token, and its row at each of them. */
__device__ __forceinline__ uint64_t *epx_route_mask(char *route)
{
    return reinterpret_cast<uint64_t *>(route);
}

__device__ __forceinline__ int32_t *epx_route_rows(char *route)
{
    return reinterpret_cast<int32_t *>(route + 8);
}

/*
 * Whole warp: record token t's routing in `route` (rows rewritten in fresh mode, from
 * the values epx_bulk_load_route read), then lane 0 arms `bar` and starts the row's loads.
 * A token that goes nowhere arms the barrier with 0 bytes (its phase completes at once).
 */
__device__ __forceinline__ void epx_dispatch_issue(const epx__cuda_shape_t &s,
                                                   const epx__cuda_dispatch_args_t &a,
                                                   const epx_dispatch_ring_t &g,
                                                   const int32_t *bases, int64_t t,
                                                   int32_t first, int32_t second, char *route,
                                                   char *slot, uint64_t *bar, int lane)
{
    const int R = s.world_size;
    if (a.fresh) {
        if (first >= 0) {
            first += bases[lane];
            a.send_row[t * R + lane] = first;
        }
        if (second >= 0) {
            second += bases[lane + 32];
            a.send_row[t * R + lane + 32] = second;
        }
    }
    const uint64_t mask = static_cast<uint64_t>(__ballot_sync(0xffffffffu, first >= 0)) |
                          static_cast<uint64_t>(__ballot_sync(0xffffffffu, second >= 0)) << 32;
    int32_t *rows = epx_route_rows(route);
    if (first >= 0)
        rows[lane] = first;
    if (second >= 0)
        rows[lane + 32] = second;
    if (lane == 0) {
        *epx_route_mask(route) = mask;
        const int64_t bytes = mask == 0 ? 0 : a.row_bytes + (g.bulk_scales ? g.scale_bytes : 0);
        epx_mbar_arrive_expect(bar, static_cast<uint32_t>(bytes));
        if (mask != 0) {
            epx_bulk_load(slot, static_cast<const char *>(a.x) + t * a.x_stride,
                          static_cast<uint32_t>(a.row_bytes), bar);
            if (g.bulk_scales)
                epx_bulk_load(slot + a.row_bytes, a.scales + t * a.scales_stride,
                              static_cast<uint32_t>(g.scale_bytes), bar);
        }
    }
    __syncwarp();
}

__global__ void __launch_bounds__(EPX_BULK_PIPES * 32)
    epx_dispatch_bulk_kernel(epx__cuda_shape_t s, epx__cuda_dispatch_args_t a,
                             epx_dispatch_ring_t g)
{
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t bars[EPX_BULK_PIPES][EPX_BULK_MAX_STAGES];
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t bases[EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    const int R = s.world_size, K = s.num_topk, S = g.stages;
    const uint64_t seq = epx_op_seq(s);
    if (!epx_dispatch_enter(s, peers, bases))
        return;
    const int lane = epx_lane(), warp = epx_warp();
    uint64_t *bar = bars[warp];
    char *slots = ring + static_cast<int64_t>(warp) * S * g.slot_bytes;
    char *routes = ring + static_cast<int64_t>(EPX_BULK_PIPES) * S * g.slot_bytes +
                   static_cast<int64_t>(warp) * S * g.route_bytes;
    epx_bulk_ring_init(bar, S);

    const int64_t first = static_cast<int64_t>(blockIdx.x) * EPX_BULK_PIPES + warp;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * EPX_BULK_PIPES;
    const int64_t count = first < a.num_tokens ? (a.num_tokens - 1 - first) / stride + 1 : 0;

    /* Fill the ring, then read ahead the routing of the first refill. */
    int32_t next_first = -1, next_second = -1;
    for (int64_t j = 0; j < count && j < S; j++) {
        epx_bulk_load_route(a, R, first + j * stride, lane, &next_first, &next_second);
        epx_dispatch_issue(s, a, g, bases, first + j * stride, next_first, next_second,
                           routes + j * g.route_bytes, slots + j * g.slot_bytes, &bar[j], lane);
    }
    if (S < count)
        epx_bulk_load_route(a, R, first + S * stride, lane, &next_first, &next_second);

    /* Top-k entries (lanes below K) are read one token ahead too. */
    int64_t next_id = -1;
    float next_weight = 0.0f;
    if (count > 0)
        epx_load_topk(a, K, first, lane, &next_id, &next_weight);

    int ok = 1;
    for (int64_t j = 0; j < count; j++) {
        const int slot = static_cast<int>(j % S);
        const uint32_t parity = static_cast<uint32_t>((j / S) & 1);
        const int64_t t = first + j * stride;
        char *route = routes + slot * g.route_bytes;
        char *row = slots + slot * g.slot_bytes;
        const int64_t lane_id = next_id;
        const float lane_weight = next_weight;
        if (j + 1 < count)
            epx_load_topk(a, K, t + stride, lane, &next_id, &next_weight);

        if (lane == 0) {
            ok = epx_mbar_wait(&bar[slot], parity, s.timeout_ns, &s.local->failed);
            if (ok) {
                uint64_t mask = *epx_route_mask(route);
                const int32_t *rows = epx_route_rows(route);
                while (mask != 0) {
                    const int r = __ffsll(static_cast<long long>(mask)) - 1;
                    mask &= mask - 1;
                    const int64_t at = rows[r];
                    epx_bulk_store(peers[r] + s.off_x + at * a.recv_pitch, row,
                                   static_cast<uint32_t>(a.row_bytes));
                    if (g.bulk_scales)
                        epx_bulk_store(peers[r] + s.off_scales + at * g.scale_bytes,
                                       row + a.row_bytes, static_cast<uint32_t>(g.scale_bytes));
                }
            } else if (!epx_failed(s)) {
                /* A local bulk load that never completed: name this rank and stage. */
                epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_DISPATCH, s.rank,
                                   s.rank, 0, t, 1);
            }
            epx_bulk_commit();
        }
        ok = __shfl_sync(0xffffffffu, ok, 0);
        if (!ok)
            break;

        /* The small parts, by the lanes, while the row's bulk stores run. */
        epx_dispatch_store_parts(s, a, peers, *epx_route_mask(route), epx_route_rows(route), t,
                                 a.num_scales > 0 && !g.bulk_scales, 1, lane_id, lane_weight,
                                 lane);
        __syncwarp();

        /* Refill the previous token's slot once its stores have read it (this token's
         * group may still be reading its own slot). */
        const int64_t refill = j - 1 + S;
        if (j >= 1 && refill < count) {
            if (lane == 0)
                epx_bulk_wait_read<1>();
            __syncwarp();
            const int previous = static_cast<int>((j - 1) % S);
            epx_dispatch_issue(s, a, g, bases, first + refill * stride, next_first, next_second,
                               routes + previous * g.route_bytes, slots + previous * g.slot_bytes,
                               &bar[previous], lane);
            if (refill + 1 < count)
                epx_bulk_load_route(a, R, first + (refill + 1) * stride, lane,
                                    &next_first, &next_second);
        }
    }
    if (lane == 0)
        epx_bulk_wait_all();
    __syncwarp();

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH], &last))
        return;
    epx_finish_exchange(s, offsetof(epx__cuda_slot_t, data_flag), seq, EPX_CUDA_STAGE_DISPATCH);
}

extern "C" cudaError_t epx__cuda_launch_dispatch_bulk(const epx__cuda_shape_t *shape,
                                                      const epx__cuda_dispatch_args_t *args,
                                                      cudaStream_t stream, int *launched)
{
    *launched = 0;
    const epx__cuda_dispatch_args_t *a = args;
    epx_dispatch_ring_t g;
    if (!epx_dispatch_ring_plan(shape, a, &g))
        return cudaSuccess;
    g.route_bytes = epx_bulk_round_up(8 + 4 * static_cast<int64_t>(shape->world_size), 16);
    int64_t budget = 0;
    cudaError_t err = epx_bulk_ring_budget(
        reinterpret_cast<const void *>(epx_dispatch_bulk_kernel), 0, &budget);
    if (err != cudaSuccess)
        return err;
    return epx_bulk_launch(epx_dispatch_bulk_kernel, shape, args, g, budget, stream, launched);
}
