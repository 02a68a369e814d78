/*
 * Dispatch data kernel, staged form (EPX_NORMAL_KERNELS=3, the default). What it moves,
 * where rows land, the fresh-mode row rewrite and the signals are those of dispatch.cu
 * (read its comment first); only who moves the bytes differs.
 *
 * Roles: each block runs EPX_STAGED_PIPES pipes side by side, each a loader warp and
 * EPX_STAGED_PIPE_WARPS store warps around its own ring of `stages` row slots in shared
 * memory (one mbarrier "full" and one "empty" a slot). All loaders take tokens from the
 * same grid-wide tickets (several at once when rows are small). A loader keeps the next
 * EPX_STAGED_AHEAD tokens' routing and first 32 top-k entries in flight, rewrites the
 * routing in fresh mode, writes into the slot the token's rows, its top-k entries and
 * the address of its row at each destination, and starts a bulk load (TMA) of the row
 * and its scales into the slot (scales that cannot travel with the row it stores
 * itself). The pipe's store warps take every slot in turn: each reads the slot's
 * destination addresses at once, stores its share of the row (16-byte vectors from
 * shared memory) to each, one of them (turning with the slots) the top-k entries
 * rewritten for each destination, then each releases the slot. So no warp's stores wait
 * for its own loads, the loads of up to `stages` tokens a pipe are in flight at once,
 * and a token's bookkeeping is done once, by its pipe's loader, not once per warp.
 *
 * Why two pipes (measured with clock stamps, docs/PERFORMANCE.md "The staged dispatch
 * with two pipes"): with 16 warps storing, every load, shared-memory access and store
 * the loader issues waits behind theirs, so one loader took 1.5-2.5 us a token and the
 * store warps waited for it; two loaders halve the tokens each must start (four are not
 * measured yet). Measured as a copy alone with one pipe: `epx bench --mode fanout`, row
 * `staged`.
 *
 * Signals: as dispatch.cu (the last block raises and awaits the data flags).
 *
 * Buffer use: as dispatch.cu. Shared memory: pipes x stages x (row + scales, rounded to
 * 128 bytes), at most EPX_BULK_RING_BYTES a block, plus each slot's routing. Falls back
 * to the vector kernel when x rows are not 16-byte aligned or two slots a pipe do not
 * fit.
 */
#include "dispatch_parts.cuh"
#include "ring_store.cuh"

/* Pipes a block: each a loader warp, its store warps and its own ring. 1, 2 or 4; a
 * build may set it (-DEPX_STAGED_PIPES=4 in CMAKE_CUDA_FLAGS) to measure another count. */
#ifndef EPX_STAGED_PIPES
#define EPX_STAGED_PIPES 2
#endif
#if EPX_STAGED_PIPES != 1 && EPX_STAGED_PIPES != 2 && EPX_STAGED_PIPES != 4
#error "EPX_STAGED_PIPES must be 1, 2 or 4"
#endif
/* Store warps a block, and a pipe's (a loader warp each pipe comes on top). */
#define EPX_STAGED_STORERS (EPX_CUDA_THREADS / 32)
#define EPX_STAGED_PIPE_WARPS (EPX_STAGED_STORERS / EPX_STAGED_PIPES)
#define EPX_STAGED_PIPE_THREADS (EPX_CUDA_THREADS / EPX_STAGED_PIPES)
#define EPX_STAGED_THREADS (EPX_CUDA_THREADS + 32 * EPX_STAGED_PIPES)
/* Slots of a pipe's ring at most (a build may set another). */
#ifndef EPX_STAGED_SLOTS
#define EPX_STAGED_SLOTS 8
#endif
/* Tokens a loader takes per ticket: 4 while a row (with its scales) is at most this many
 * bytes, else 1. Measured on the copy alone with one loader a block (one H200, 8 ranks,
 * 8 SMs a rank): rows of 7168 bytes 20% faster by fours, rows of 14336 bytes 8% slower;
 * not measured again with two pipes. A build may set it (-DEPX_STAGED_SMALL_ROW=...),
 * as EPX_STAGED_AHEAD below, to measure another. */
#ifndef EPX_STAGED_SMALL_ROW
#define EPX_STAGED_SMALL_ROW 8192
#endif
/* Tokens whose routing and top-k entries a loader has in flight (read ahead), and
 * tickets it has taken ahead of the chunk it works on. With one token ahead a bf16
 * token's routing took 2800 cycles to arrive, with four 1800-2000 (one H200, 8 SMs a
 * rank, clock stamps); four tickets ahead instead of two changed nothing measurable. */
#ifndef EPX_STAGED_AHEAD
#define EPX_STAGED_AHEAD 4
#endif
#define EPX_STAGED_TICKETS 4
/* Below this many blocks a rank the vector kernel runs instead (0: never). At 4 SMs a
 * rank the copy alone ran faster with the vector loop than staged (0.52 against 0.45 of
 * the floor, bf16; fp8 0.50 against 0.40), at 8 the other way round (0.73 against
 * 0.82; `epx bench --mode fanout`, one H200, 8 ranks, docs/PERFORMANCE.md, ninth
 * session); the dispatch itself not yet measured at small budgets, so a build may set
 * it (-DEPX_STAGED_MIN_BLOCKS=...) to A/B it. */
#ifndef EPX_STAGED_MIN_BLOCKS
#define EPX_STAGED_MIN_BLOCKS 0
#endif

/* The ring's shared state: barriers, and each slot's token routing. */
typedef struct {
    uint64_t full[EPX_STAGED_SLOTS];  /* the loader's arrival + the slot's bytes */
    uint64_t empty[EPX_STAGED_SLOTS]; /* one arrival per store warp of the pipe */
    uint64_t mask[EPX_STAGED_SLOTS];  /* ranks receiving the slot's token; 0 = no more */
    int64_t token[EPX_STAGED_SLOTS];
    int32_t count[EPX_STAGED_SLOTS];                  /* ranks receiving it */
    char *dst[EPX_STAGED_SLOTS][EPX_CUDA_MAX_RANKS];  /* the row's place at each of them */
    int32_t rows[EPX_STAGED_SLOTS][EPX_CUDA_MAX_RANKS]; /* the token's row at rank r */
    int64_t ids[EPX_STAGED_SLOTS][32];  /* top-k entries 0..31 (epx_load_topk) */
    float weights[EPX_STAGED_SLOTS][32];
} epx_staged_state_t;

/*
 * Whole warp: 1 once `slot` is free for its lap `lap` (its store warps released the lap
 * before), 0 when the wait gave up (recorded, naming token t).
 */
__device__ __forceinline__ int epx_staged_wait_free(const epx__cuda_shape_t &s,
                                                    epx_staged_state_t &st, int slot,
                                                    uint32_t lap, int64_t t, int lane)
{
    if (lap == 0)
        return 1;
    const int ok =
        epx_mbar_wait_warp(&st.empty[slot], (lap - 1) & 1, s.timeout_ns, &s.local->failed);
    if (!ok && lane == 0 && !epx_failed(s))
        epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_DISPATCH, s.rank, s.rank, 0,
                           t, 1);
    return ok;
}

/* What the loader reads of token t before it fills a slot: lane's routing (ranks lane
 * and lane + 32; -1 where not sent) and top-k entry `lane`. */
typedef struct {
    int64_t t;
    int32_t first, second;
    int64_t id;
    float weight;
} epx_staged_token_t;

/* Token t's routing and top-k entries (nothing sent, past the last token). */
__device__ __forceinline__ epx_staged_token_t epx_staged_read(const epx__cuda_dispatch_args_t &a,
                                                              int R, int K, int64_t t, int lane)
{
    epx_staged_token_t k = {t, -1, -1, -1, 0.0f};
    if (t < a.num_tokens) {
        epx_bulk_load_route(a, R, t, lane, &k.first, &k.second);
        epx_load_topk(a, K, t, lane, &k.id, &k.weight);
    }
    return k;
}

/*
 * The order in which the loader takes tokens: chunks of `chunk` consecutive tokens, one
 * chunk a ticket (a grid-wide counter), the tickets taken EPX_STAGED_TICKETS chunks ahead
 * so that an atomic's latency hides behind the tokens (one thread takes them all, so they
 * come in the order taken). Past the last token the order goes on
 * (tokens >= num_tokens, which read nothing); tickets only grow, so it never comes back.
 */
typedef struct {
    uint32_t *tickets;
    int64_t chunk, t, end;
    uint32_t ticket[EPX_STAGED_TICKETS]; /* lane 0's: the next chunks', in order */
} epx_staged_order_t;

__device__ __forceinline__ uint32_t epx_staged_ticket(uint32_t *tickets, int lane)
{
    return lane == 0 ? atomicAdd(tickets, 1u) : 0u;
}

__device__ __forceinline__ void epx_staged_order_start(epx_staged_order_t *o, uint32_t *tickets,
                                                       int64_t chunk, int lane)
{
    o->tickets = tickets;
    o->chunk = chunk;
    const uint32_t first = epx_staged_ticket(tickets, lane);
#pragma unroll
    for (int i = 0; i < EPX_STAGED_TICKETS; i++)
        o->ticket[i] = epx_staged_ticket(tickets, lane);
    o->t = static_cast<int64_t>(__shfl_sync(0xffffffffu, first, 0)) * chunk;
    o->end = o->t + chunk;
}

/* Whole warp: the next token in the order. */
__device__ __forceinline__ int64_t epx_staged_order_next(epx_staged_order_t *o, int lane)
{
    const int64_t t = o->t;
    if (++o->t == o->end) {
        o->t = static_cast<int64_t>(__shfl_sync(0xffffffffu, o->ticket[0], 0)) * o->chunk;
        o->end = o->t + o->chunk;
#pragma unroll
        for (int i = 0; i + 1 < EPX_STAGED_TICKETS; i++)
            o->ticket[i] = o->ticket[i + 1];
        o->ticket[EPX_STAGED_TICKETS - 1] = epx_staged_ticket(o->tickets, lane);
    }
    return t;
}

/*
 * A pipe's loader warp: every token its tickets give it, then a last slot with an empty
 * mask. Returns early only when a wait for a free slot gave up (recorded).
 */
__device__ __forceinline__ void epx_staged_load(const epx__cuda_shape_t &s,
                                                const epx__cuda_dispatch_args_t &a,
                                                const epx_dispatch_ring_t &g, epx_staged_state_t &st,
                                                char *const *peers, const int32_t *bases,
                                                char *ring)
{
    const int R = s.world_size, K = s.num_topk, lane = epx_lane();
    const int64_t T = a.num_tokens;
    epx_staged_order_t order;
    epx_staged_order_start(
        &order, &s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH_TOKENS],
        a.row_bytes + (g.bulk_scales ? g.scale_bytes : 0) <= EPX_STAGED_SMALL_ROW ? 4 : 1, lane);
    /* Lane's two ranks' first receive row and memory, kept in registers: shared-memory
     * reads wait behind the store warps' traffic. */
    const int32_t base_first = lane < R ? bases[lane] : 0;
    const int32_t base_second = lane + 32 < R ? bases[lane + 32] : 0;
    char *const to_first = lane < R ? peers[lane] + s.off_x : nullptr;
    char *const to_second = lane + 32 < R ? peers[lane + 32] + s.off_x : nullptr;
    /* The next EPX_STAGED_AHEAD tokens' routing and top-k entries, in flight. */
    epx_staged_token_t ahead[EPX_STAGED_AHEAD];
#pragma unroll
    for (int i = 0; i < EPX_STAGED_AHEAD; i++)
        ahead[i] = epx_staged_read(a, R, K, epx_staged_order_next(&order, lane), lane);
    int slot = 0;
    uint32_t lap = 0;
    while (ahead[0].t < T) {
        const epx_staged_token_t cur = ahead[0];
        const int64_t t = cur.t;
#pragma unroll
        for (int i = 0; i + 1 < EPX_STAGED_AHEAD; i++)
            ahead[i] = ahead[i + 1];
        ahead[EPX_STAGED_AHEAD - 1] =
            epx_staged_read(a, R, K, epx_staged_order_next(&order, lane), lane);
        int32_t first = cur.first, second = cur.second;
        if (a.fresh) {
            if (first >= 0) {
                first += base_first;
                a.send_row[t * R + lane] = first;
            }
            if (second >= 0) {
                second += base_second;
                a.send_row[t * R + lane + 32] = second;
            }
        }
        const uint64_t mask = static_cast<uint64_t>(__ballot_sync(0xffffffffu, first >= 0)) |
                              static_cast<uint64_t>(__ballot_sync(0xffffffffu, second >= 0))
                                  << 32;
        if (mask != 0) {
            if (!epx_staged_wait_free(s, st, slot, lap, t, lane))
                return;
            /* Each destination's place, in rank order, so the store warps read them all
             * at once instead of one lookup per destination between their stores. */
            if (first >= 0) {
                st.rows[slot][lane] = first;
                st.dst[slot][__popcll(mask & ((1ull << lane) - 1))] =
                    to_first + static_cast<int64_t>(first) * a.recv_pitch;
            }
            if (second >= 0) {
                st.rows[slot][lane + 32] = second;
                st.dst[slot][__popcll(mask & ((1ull << (lane + 32)) - 1))] =
                    to_second + static_cast<int64_t>(second) * a.recv_pitch;
            }
            st.ids[slot][lane] = cur.id;
            st.weights[slot][lane] = cur.weight;
            __syncwarp();
            if (a.num_scales > 0 && !g.bulk_scales)
                epx_dispatch_store_parts(s, a, peers, mask, st.rows[slot], t, 1, 0, cur.id,
                                         cur.weight, lane);
            if (lane == 0) {
                st.mask[slot] = mask;
                st.count[slot] = __popcll(mask);
                st.token[slot] = t;
                char *dst = ring + slot * g.slot_bytes;
                const int64_t bytes = a.row_bytes + (g.bulk_scales ? g.scale_bytes : 0);
                epx_bulk_fence_shared();
                epx_mbar_arrive_expect(&st.full[slot], static_cast<uint32_t>(bytes));
                epx_bulk_load(dst, static_cast<const char *>(a.x) + t * a.x_stride,
                              static_cast<uint32_t>(a.row_bytes), &st.full[slot]);
                if (g.bulk_scales)
                    epx_bulk_load(dst + a.row_bytes, a.scales + t * a.scales_stride,
                                  static_cast<uint32_t>(g.scale_bytes), &st.full[slot]);
            }
            __syncwarp();
            epx_ring_advance(&slot, &lap, g.stages);
        }
    }
    /* No more tokens: the store warps stop at this slot. */
    if (!epx_staged_wait_free(s, st, slot, lap, T, lane))
        return;
    if (lane == 0) {
        st.mask[slot] = 0;
        epx_mbar_arrive_expect(&st.full[slot], 0);
    }
}

/*
 * A store warp of a pipe (`warp` and `thread`: its place in the pipe): every slot in
 * turn until one with an empty mask, its share of the row (and scales) to each
 * destination. A thread's first unit turns by a quarter of the pipe each slot, so the
 * units past a multiple of the pipe are not always the same warps'. Returns early only
 * when a wait for a slot gave up (recorded).
 */
__device__ __forceinline__ void epx_staged_store(const epx__cuda_shape_t &s,
                                                 const epx__cuda_dispatch_args_t &a,
                                                 const epx_dispatch_ring_t &g,
                                                 epx_staged_state_t &st, char *const *peers,
                                                 const char *ring, int warp, int thread)
{
    const int units = static_cast<int>(a.row_bytes / 16), lane = epx_lane();
    const int scale_units = g.bulk_scales ? static_cast<int>(g.scale_bytes / 16) : 0;
    int slot = 0;
    uint32_t lap = 0;
    for (int k = 0;; k++) {
        /* index: the slots this warp had taken (no token is known here) */
        if (!epx_ring_wait_full(s, &st.full[slot], lap, k, 1))
            return;
        const uint64_t mask = st.mask[slot];
        if (mask == 0)
            return;
        const int32_t *rows = st.rows[slot];
        const int count = st.count[slot];
        const char *in = ring + slot * g.slot_bytes;
        const int me = epx_ring_first_unit<EPX_STAGED_PIPE_THREADS>(thread, k);
        epx_ring_store_row<EPX_STAGED_PIPE_THREADS>(in, units, st.dst[slot], count, me);
        if ((k & (EPX_STAGED_PIPE_WARPS - 1)) == warp)
            epx_dispatch_store_parts(s, a, peers, mask, rows, st.token[slot], 0, 1,
                                     st.ids[slot][lane], st.weights[slot][lane], lane);
        if (me < scale_units) {
            const int4 v = reinterpret_cast<const int4 *>(in + a.row_bytes)[me];
            for (uint64_t m = mask; m != 0; m &= m - 1) {
                const int r = __ffsll(static_cast<long long>(m)) - 1;
                epx_st_v4(peers[r] + s.off_scales + static_cast<int64_t>(rows[r]) * g.scale_bytes +
                              static_cast<int64_t>(me) * 16,
                          v);
            }
        }
        __syncwarp();
        if (lane == 0)
            epx_mbar_arrive(&st.empty[slot]);
        epx_ring_advance(&slot, &lap, g.stages);
    }
}

__global__ void __launch_bounds__(EPX_STAGED_THREADS)
    epx_dispatch_staged_kernel(epx__cuda_shape_t s, epx__cuda_dispatch_args_t a,
                               epx_dispatch_ring_t g)
{
    extern __shared__ __align__(128) char ring[];
    __shared__ epx_staged_state_t st[EPX_STAGED_PIPES];
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t bases[EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    /* Launched early (epx_launch_early): the count exchange's results first. */
    epx_wait_previous();
    const uint64_t seq = epx_op_seq(s);
    if (!epx_dispatch_enter(s, peers, bases))
        return;
    if (threadIdx.x == 0) {
        for (int p = 0; p < EPX_STAGED_PIPES; p++)
            for (int i = 0; i < g.stages; i++) {
                epx_mbar_init(&st[p].full[i], 1);
                epx_mbar_init(&st[p].empty[i], EPX_STAGED_PIPE_WARPS);
            }
        epx_mbar_init_fence();
    }
    __syncthreads();
    const int warp = epx_warp();
    if (warp < EPX_STAGED_STORERS) {
        const int p = warp / EPX_STAGED_PIPE_WARPS;
        epx_staged_store(s, a, g, st[p], peers, ring + p * g.stages * g.slot_bytes,
                         warp % EPX_STAGED_PIPE_WARPS,
                         static_cast<int>(threadIdx.x) % EPX_STAGED_PIPE_THREADS);
    } else {
        const int p = warp - EPX_STAGED_STORERS;
        epx_staged_load(s, a, g, st[p], peers, bases, ring + p * g.stages * g.slot_bytes);
    }

    if (!epx_last_block(&s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH], &last))
        return;
    epx_finish_exchange(s, offsetof(epx__cuda_slot_t, data_flag), seq, EPX_CUDA_STAGE_DISPATCH);
}

extern "C" cudaError_t epx__cuda_launch_dispatch_staged(const epx__cuda_shape_t *shape,
                                                        const epx__cuda_dispatch_args_t *args,
                                                        cudaStream_t stream, int *launched)
{
    *launched = 0;
    const epx__cuda_dispatch_args_t *a = args;
    if (a->num_blocks < EPX_STAGED_MIN_BLOCKS)
        return cudaSuccess;
    epx_dispatch_ring_t g;
    if (!epx_dispatch_ring_plan(shape, a, &g))
        return cudaSuccess;
    /* Scales travelling with the row are stored one 16-byte unit per thread of a pipe. */
    if (g.bulk_scales && g.scale_bytes / 16 > EPX_STAGED_PIPE_THREADS)
        return cudaSuccess;
    const void *kernel = reinterpret_cast<const void *>(epx_dispatch_staged_kernel);
    int64_t budget = 0;
    cudaError_t err = epx_bulk_ring_budget(kernel, 0, &budget);
    if (err != cudaSuccess)
        return err;
    int64_t stages = 0, ring_bytes = 0;
    err = epx_bulk_ring_fit(kernel, budget, EPX_STAGED_PIPES, g.slot_bytes, EPX_STAGED_SLOTS,
                            &stages, &ring_bytes);
    if (err != cudaSuccess || stages == 0)
        return err;
    g.stages = static_cast<int>(stages);
    *launched = 1;
    return epx_launch_early(epx_dispatch_staged_kernel, dim3(a->num_blocks),
                            dim3(EPX_STAGED_THREADS), static_cast<size_t>(ring_bytes), stream,
                            *shape, *args, g);
}
