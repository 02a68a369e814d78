/*
 * Combine pull kernel, bulk-copy form (EPX_NORMAL_KERNELS=2). What it reads, the order of
 * the sums (bias first, then the sources in rank order or the order of combine_order.cuh:
 * bit-exact with combine.cu), the
 * row checks and the signals are those of combine.cu (read its comment first); it runs
 * after the same ready kernel.
 *
 * Roles: each block has EPX_BULK_PIPES warps, each with its own ring of `stages` slots
 * in shared memory over its tokens (grid-stride). A token's row is cut into `chunks`
 * pieces of `chunk_bytes`; one item is one piece of one token from every rank that holds
 * the token, so a slot has room for world_size pieces. Lane 0 starts an item's bulk loads
 * straight from each source rank's x (CUDA IPC mapping) into the slot; the whole warp
 * waits for the slot's barrier, sums the pieces in fp32 (each lane 16-byte vectors of
 * shared memory), writes the bf16 result with vector stores, then refills the slot with
 * the item `stages` ahead. While one item is summed, the loads of the next stages-1
 * items are in flight.
 *
 * Per-row bookkeeping (the source list from send_row, its row checks) happens when an
 * item is issued, stages-1 items ahead, with its loads issued one iteration before.
 *
 * Signals: as combine.cu. Buffer use: reads only. Shared memory: stages x (world_size
 * pieces + the slot's source list) per warp, sized by the launcher (at most
 * EPX_BULK_RING_BYTES per block). Falls back to the vector kernel when a ring of two
 * slots does not fit.
 */
#include "bulk.cuh"
#include "combine_order.cuh"
#include "reduce.cuh"
#include "signal.cuh"

/* 16-byte vectors of one item per lane, at most: pieces of up to 32 x 16 x 4 bytes. */
#define EPX_COMBINE_BULK_UNITS 4
#define EPX_COMBINE_BULK_MAX_CHUNK (32 * 16 * EPX_COMBINE_BULK_UNITS)

typedef struct {
    int stages;
    int chunks;          /* items per token */
    int64_t chunk_bytes; /* bf16 bytes of one item (a multiple of 16) */
    int64_t slot_bytes;  /* world_size pieces, rounded up to 128 */
    int64_t route_bytes; /* one slot's sources: the count, then (rank, row) each */
} epx_combine_ring_t;

__device__ __forceinline__ int32_t *epx_sources_count(char *route)
{
    return reinterpret_cast<int32_t *>(route);
}

/* Source i: [2i] its rank, [2i + 1] its row there. */
__device__ __forceinline__ int32_t *epx_sources(char *route)
{
    return reinterpret_cast<int32_t *>(route + 16);
}

/*
 * Whole warp: the sources of piece `piece` of token t in summation order (rows past a rank's
 * x are recorded once per token and skipped, as in combine.cu), then lane 0 arms `bar`
 * and starts one bulk load per source into `slot`.
 */
__device__ __forceinline__ void epx_combine_issue(const epx__cuda_shape_t &s,
                                                  const epx__cuda_combine_args_t &a,
                                                  const epx_combine_ring_t &g,
                                                  const char *const *x_base,
                                                  const int64_t *x_stride,
                                                  const int64_t *x_rows, int64_t t, int piece,
                                                  int32_t first, int32_t second, char *route,
                                                  char *slot, uint64_t *bar, int lane)
{
    const int me = s.rank;
    const int r0 = lane, r1 = lane + 32;
    if (first >= 0 && first >= x_rows[r0]) {
        if (piece == 0)
            epx_record_failure(s, EPX_CUDA_FAIL_ROWS, EPX_CUDA_STAGE_COMBINE_READY, r0, me,
                               first, x_rows[r0], 1);
        first = -1;
    }
    if (second >= 0 && second >= x_rows[r1]) {
        if (piece == 0)
            epx_record_failure(s, EPX_CUDA_FAIL_ROWS, EPX_CUDA_STAGE_COMBINE_READY, r1, me,
                               second, x_rows[r1], 1);
        second = -1;
    }
    int at0 = 0, at1 = 0;
    const int n = epx_combine_places(a, s.num_topk, s.num_local_experts, s.world_size, t,
                                     first >= 0, second >= 0, lane, &at0, &at1);
    int32_t *sources = epx_sources(route);
    if (first >= 0) {
        sources[2 * at0] = r0;
        sources[2 * at0 + 1] = first;
    }
    if (second >= 0) {
        sources[2 * at1] = r1;
        sources[2 * at1 + 1] = second;
    }
    __syncwarp();
    if (lane == 0) {
        *epx_sources_count(route) = n;
        const int64_t row_bytes = s.hidden * 2;
        const int64_t offset = static_cast<int64_t>(piece) * g.chunk_bytes;
        const int64_t left = row_bytes - offset;
        const uint32_t bytes = static_cast<uint32_t>(left < g.chunk_bytes ? left : g.chunk_bytes);
        /* The lanes read this slot's previous item with generic loads. */
        epx_bulk_fence_shared();
        epx_mbar_arrive_expect(bar, bytes * static_cast<uint32_t>(n));
        for (int i = 0; i < n; i++) {
            const int r = sources[2 * i];
            const char *src = x_base[r] + static_cast<int64_t>(sources[2 * i + 1]) * x_stride[r] +
                              offset;
            epx_bulk_load(slot + static_cast<int64_t>(i) * g.chunk_bytes, src, bytes, bar);
        }
    }
    __syncwarp();
}

__global__ void __launch_bounds__(EPX_BULK_PIPES * 32)
    epx_combine_bulk_kernel(epx__cuda_shape_t s, epx__cuda_combine_args_t a,
                            epx_combine_ring_t g)
{
    extern __shared__ __align__(128) char ring[];
    __shared__ uint64_t bars[EPX_BULK_PIPES][EPX_BULK_MAX_STAGES];
    __shared__ const char *x_base[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_stride[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_rows[EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    const int R = s.world_size, K = s.num_topk, me = s.rank, S = g.stages;
    const uint64_t seq = epx_op_seq(s);
    /* The ready exchange failed on this rank (or an earlier operation did). */
    if (epx_block_failed(s))
        return;
    /* Every peer's input location, acquired by the ready kernel before this one; ranks
     * past the last one read as holding nothing. */
    for (int r = threadIdx.x; r < EPX_CUDA_MAX_RANKS; r += blockDim.x) {
        if (r < R) {
            const volatile epx__cuda_slot_t *slot = epx_slot(s, me, r);
            x_base[r] = epx_peer_x(s, r, slot);
            x_stride[r] = slot->ready_stride;
            x_rows[r] = slot->ready_rows;
        } else {
            x_base[r] = NULL;
            x_stride[r] = 0;
            x_rows[r] = 0;
        }
    }
    const int lane = epx_lane(), warp = epx_warp();
    uint64_t *bar = bars[warp];
    char *slots = ring + static_cast<int64_t>(warp) * S * g.slot_bytes;
    char *routes = ring + static_cast<int64_t>(EPX_BULK_PIPES) * S * g.slot_bytes +
                   static_cast<int64_t>(warp) * S * g.route_bytes;
    epx_bulk_ring_init(bar, S);

    const int64_t first = static_cast<int64_t>(blockIdx.x) * EPX_BULK_PIPES + warp;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * EPX_BULK_PIPES;
    const int64_t count = first < a.num_tokens ? (a.num_tokens - 1 - first) / stride + 1 : 0;
    const int64_t items = count * g.chunks;
    const int64_t row_bytes = s.hidden * 2;

    /* Fill the ring, then read ahead the sources of the first refill. */
    int32_t next_first = -1, next_second = -1;
    for (int64_t i = 0; i < items && i < S; i++) {
        const int64_t t = first + (i / g.chunks) * stride;
        epx_bulk_load_route(a, R, t, lane, &next_first, &next_second);
        epx_combine_issue(s, a, g, x_base, x_stride, x_rows, t, static_cast<int>(i % g.chunks),
                          next_first, next_second, routes + i * g.route_bytes,
                          slots + i * g.slot_bytes, &bar[i], lane);
    }
    if (S < items)
        epx_bulk_load_route(a, R, first + (S / g.chunks) * stride, lane, &next_first, &next_second);

    for (int64_t i = 0; i < items; i++) {
        const int slot_index = static_cast<int>(i % S);
        const uint32_t parity = static_cast<uint32_t>((i / S) & 1);
        const int piece = static_cast<int>(i % g.chunks);
        const int64_t t = first + (i / g.chunks) * stride;
        char *route = routes + slot_index * g.route_bytes;
        const char *slot = slots + slot_index * g.slot_bytes;
        const int64_t offset = static_cast<int64_t>(piece) * g.chunk_bytes;
        const int64_t left = row_bytes - offset;
        const int64_t units = (left < g.chunk_bytes ? left : g.chunk_bytes) / 16;

        const int ok = __all_sync(0xffffffffu,
                                  epx_mbar_wait(&bar[slot_index], parity, s.timeout_ns,
                                                &s.local->failed));
        if (!ok) {
            /* A bulk load from a peer that never completed (or another block failed). */
            if (lane == 0 && !epx_failed(s))
                epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_COMBINE_READY, me,
                                   me, 0, t, 1);
            break;
        }
        const int n = *epx_sources_count(route);
        const int32_t *sources = epx_sources(route);

        /* DeepEP's bias: the sum starts from bias_0 + bias_1, then adds the rows. */
        float acc[EPX_COMBINE_BULK_UNITS][8];
        epx_start_sums<EPX_COMBINE_BULK_UNITS>(acc, a, t, offset, 0, units, lane);
        /* Sources in summation order, one add each: the reference's order. */
        for (int j = 0; j < n; j++) {
            const char *piece_of_j = slot + static_cast<int64_t>(j) * g.chunk_bytes;
#pragma unroll
            for (int u = 0; u < EPX_COMBINE_BULK_UNITS; u++) {
                const int64_t unit = static_cast<int64_t>(u) * 32 + lane;
                if (unit < units)
                    epx_add_bf16x8(acc[u],
                                   *reinterpret_cast<const int4 *>(piece_of_j + unit * 16));
            }
        }
        char *out = static_cast<char *>(a.out_x) + t * a.out_stride + offset;
        epx_store_sums<EPX_COMBINE_BULK_UNITS>(out, a.out_align, acc, 0, units, lane);
        if (a.has_weights && piece == 0) {
            for (int k = lane; k < K; k += 32) {
                float sum = 0.0f;
                for (int j = 0; j < n; j++) {
                    const float *weights = reinterpret_cast<const float *>(
                                               epx_peer(s, sources[2 * j]) +
                                               s.off_combine_weights) +
                                           static_cast<int64_t>(sources[2 * j + 1]) * K;
                    sum += __ldcg(weights + k);
                }
                a.out_weights[t * a.out_weights_stride + k] = sum;
            }
        }
        __syncwarp();

        /* The lanes are done with this slot: refill it with the item `stages` ahead. */
        const int64_t refill = i + S;
        if (refill < items) {
            const int64_t refill_token = first + (refill / g.chunks) * stride;
            epx_combine_issue(s, a, g, x_base, x_stride, x_rows, refill_token,
                              static_cast<int>(refill % g.chunks), next_first, next_second,
                              route, slots + slot_index * g.slot_bytes, &bar[slot_index], lane);
            if (refill + 1 < items)
                epx_bulk_load_route(a, R, first + ((refill + 1) / g.chunks) * stride, lane,
                                    &next_first, &next_second);
        }
    }

    if (!epx_last_block_reader(&s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE], &last))
        return;
    epx_finish_exchange(s, offsetof(epx__cuda_slot_t, done_flag), seq, EPX_CUDA_STAGE_COMBINE_DONE);
}

extern "C" cudaError_t epx__cuda_launch_combine_bulk(const epx__cuda_shape_t *shape,
                                                     const epx__cuda_combine_args_t *args,
                                                     cudaStream_t stream, int *launched)
{
    *launched = 0;
    const int64_t row_bytes = shape->hidden * 2;
    const int64_t R = shape->world_size;
    if (row_bytes % 16 != 0 || row_bytes <= 0)
        return cudaSuccess;
    int64_t budget = 0;
    cudaError_t err = epx_bulk_ring_budget(
        reinterpret_cast<const void *>(epx_combine_bulk_kernel), 0, &budget);
    if (err != cudaSuccess)
        return err;
    epx_combine_ring_t g = {};
    g.route_bytes = epx_bulk_round_up(16 + 8 * R, 16);
    /* Aim at four slots per warp, in pieces that cut the row evenly. */
    const int64_t per_warp = budget / EPX_BULK_PIPES;
    int64_t widest = (per_warp / 4 - g.route_bytes) / R / 16 * 16;
    if (widest > EPX_COMBINE_BULK_MAX_CHUNK)
        widest = EPX_COMBINE_BULK_MAX_CHUNK;
    if (widest < 128)
        return cudaSuccess;
    const int64_t chunks = (row_bytes + widest - 1) / widest;
    g.chunks = static_cast<int>(chunks);
    g.chunk_bytes = epx_bulk_round_up((row_bytes + chunks - 1) / chunks, 16);
    g.slot_bytes = epx_bulk_round_up(R * g.chunk_bytes, 128);
    return epx_bulk_launch(epx_combine_bulk_kernel, shape, args, g, budget, stream, launched);
}
