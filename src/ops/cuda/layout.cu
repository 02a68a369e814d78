/*
 * Layout and count exchange: the small kernels that run before any token row moves.
 *
 * epx_layout_kernel (get_dispatch_layout): reads topk_idx only. Each block counts its
 * tokens per rank and per expert in shared memory and adds them to the outputs with
 * one atomic per counter; is_token_in_rank is written per token. Purely local.
 *
 * epx_notify_kernel (first kernel of every dispatch): blocks of 1024 threads; one block
 * in cached mode, in fresh mode a block per round of 1024 tokens (within the SM budget
 * and EPX_CUDA_SCAN_TILES; a block then takes several rounds).
 *   1. Fresh mode: for each token the set of destination ranks (from topk_idx, or the
 *      caller's is_token_in_rank bits, whose per-expert counts then come from the
 *      caller's num_tokens_per_expert instead of being counted) and its ordinal among
 *      this rank's tokens to each destination, written to the handle's send_row (16-byte
 *      stores), counts per rank and per expert. Each block scans its tile of tokens (warp
 *      ballots + per-warp totals scanned by one warp's shuffles, 1024 tokens a round),
 *      starting from the tiles before it (a decoupled look-back over the tiles' published
 *      counts, in the order the blocks started); the last block to finish goes on alone
 *      with the totals. A token's ids are loaded at once (notify.cuh), so each round
 *      waits for memory once. Expert ids out of range are recorded, never followed.
 *   2. One warp per peer writes this rank's count row [R], its per-expert counts for
 *      the peer's experts [L] and its input status into the peer's control area, then
 *      the count flag (release, system scope) carrying the operation's sequence number.
 *      Cached mode sends the flag only. The flag is also the "this rank entered the
 *      operation" signal: no peer writes into this rank's receive region before it.
 *   3. Waits (acquire, with timeout) for every peer's flag, then derives where its
 *      tokens land at each receiver (sum of lower ranks' counts), how many rows it
 *      receives and per local expert (rounded up to the alignment), the handle's
 *      rank_prefix_matrix (prefix sums of the count rows over sources), and, when the host
 *      waits, publishes them to host-mapped memory followed by the host's ticket.
 * Buffer use: the count rows are double-buffered by sequence parity (2 * R * (R + L)
 * int32 per rank); shared memory is E + 34 * 64 int32.
 */
#include "notify.cuh"

__global__ void __launch_bounds__(EPX_CUDA_THREADS)
    epx_layout_kernel(epx__cuda_shape_t s, epx__cuda_layout_args_t a)
{
    extern __shared__ int32_t expert_counts[]; /* [E], then [R] */
    int32_t *rank_counts = expert_counts + s.num_experts;
    const int R = s.world_size;
    for (int i = threadIdx.x; i < s.num_experts + R; i += blockDim.x)
        expert_counts[i] = 0;
    __syncthreads();

    int bad = 0;
    int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += step) {
        uint64_t mask = epx_token_mask(s, a.topk_idx + t * a.topk_stride, t, expert_counts,
                                       EPX_CUDA_STAGE_LAYOUT, &bad);
        for (int r = 0; r < R; r++) {
            int in_rank = (int)((mask >> r) & 1u);
            if (in_rank)
                atomicAdd(&rank_counts[r], 1);
            if (a.is_token_in_rank != NULL)
                a.is_token_in_rank[t * a.in_rank_stride + r] = (uint8_t)in_rank;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        if (expert_counts[i] != 0)
            atomicAdd(&a.num_tokens_per_expert[i], expert_counts[i]);
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (rank_counts[r] != 0)
            atomicAdd(&a.num_tokens_per_rank[r], rank_counts[r]);
}

/* Step 2: this rank's counts (fresh) or just its arrival (cached) to every peer. */
__device__ void epx_notify_send(const epx__cuda_shape_t &s, const epx__cuda_notify_args_t &a,
                                const int32_t *expert_counts, const int32_t *running,
                                int status, uint64_t seq)
{
    const int R = s.world_size, L = s.num_local_experts, me = s.rank;
    const int parity = (int)(seq & 1u);
    const int lane = epx_lane();
    for (int r = epx_warp(); r < R; r += (int)(blockDim.x >> 5)) {
        char *peer = epx_peer(s, r);
        epx__cuda_slot_t *slot = epx_slot(s, r, me);
        if (a.topk_idx != NULL || a.is_token_in_rank != NULL) {
            int32_t *row = reinterpret_cast<int32_t *>(peer + s.off_rank_counts) +
                           ((int64_t)parity * R + me) * R;
            int32_t *experts = reinterpret_cast<int32_t *>(peer + s.off_expert_counts) +
                               ((int64_t)parity * R + me) * L;
            for (int i = lane; i < R; i += 32)
                row[i] = running[i];
            for (int i = lane; i < L; i += 32)
                experts[i] = expert_counts[r * L + i];
        }
        if (lane == 0)
            slot->status[parity] = status;
        epx_fence_acq_rel_sys();
        __syncwarp();
        if (lane == 0)
            epx_st_release_sys(&slot->count_flag[parity], seq);
    }
}

/* Step 3 (fresh mode): receive offsets, received counts, results for the host. */
__device__ void epx_notify_finish(const epx__cuda_shape_t &s, const epx__cuda_notify_args_t &a,
                                  uint64_t seq)
{
    const int R = s.world_size, L = s.num_local_experts, me = s.rank;
    const int parity = (int)(seq & 1u);
    char *mine = epx_peer(s, me);
    const volatile int32_t *matrix =
        reinterpret_cast<const int32_t *>(mine + s.off_rank_counts) + (int64_t)parity * R * R;
    const volatile int32_t *experts =
        reinterpret_cast<const int32_t *>(mine + s.off_expert_counts) + (int64_t)parity * R * L;
    const int align = a.expert_alignment > 1 ? a.expert_alignment : 1;

    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int32_t base = 0;
        for (int src = 0; src < me; src++)
            base += matrix[src * R + r];
        s.local->base[r] = base;
    }
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
        int32_t count = 0;
        for (int src = 0; src < R; src++)
            count += experts[src * L + l];
        count = (count + align - 1) / align * align;
        a.recv_per_expert[l] = count;
        if (a.ticket != 0)
            s.mapped_recv_per_expert[l] = count;
    }
    if (a.ticket != 0)
        for (int i = threadIdx.x; i < R * R; i += blockDim.x)
            s.mapped_rank_counts[i] = matrix[i];
    /* DeepEP's rank_prefix_matrix for the handle: [s][r] = tokens ranks 0..s sent to r. */
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int32_t sum = 0;
        for (int src = 0; src < R; src++) {
            sum += matrix[src * R + r];
            a.rank_prefix[src * R + r] = sum;
        }
    }
    if (threadIdx.x == 0) {
        int32_t total = 0;
        for (int src = 0; src < R; src++)
            total += matrix[src * R + me];
        *a.recv_count = total;
        s.mapped->num_recv = total;
    }
}

/*
 * An earlier tile's state once it has published this operation's count (stamp + 1 or
 * more), or 0 after the timeout (recorded; a tile never waits on anything before it
 * publishes, so this is a bug or a dead GPU; the peers are told, as the count flag will
 * not come). Peers' abort words are not looked at here: before its last block this
 * kernel records no failure of theirs (epx_notify_kernel).
 */
__device__ uint64_t epx_scan_tile_wait(const epx__cuda_shape_t &s, const epx__cuda_scan_tile_t *tile,
                                       uint64_t stamp)
{
    const uint64_t start = epx_globaltimer();
    for (;;) {
        const uint64_t state = epx_ld_volatile_u64(&tile->state);
        if (state >= stamp + EPX_CUDA_SCAN_AGGREGATE) {
            __threadfence(); /* its counts after its state */
            return state;
        }
        if (epx_globaltimer() - start > static_cast<uint64_t>(s.timeout_ns)) {
            epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_NOTIFY, s.rank, s.rank, 0,
                               0, 1);
            return 0;
        }
    }
}

/*
 * Step 1 (fresh mode) for one tile, the tokens [first, end) of the block that drew ticket
 * `tile`: counts the tile's tokens per destination (and this rank's per expert, in
 * shared memory), publishes them, adds up the tiles before it (decoupled look-back: a
 * tile's running total where it is published, else its own count, further back; every
 * earlier tile's block started before this one, so the waits end), then writes the
 * tile's ordinals. A one-round tile keeps its masks in registers; longer tiles read
 * their ids again in the second pass. Bad ids are only noted (the lowest entry index):
 * the last block records the failure, so that no block sees this kernel's own failure
 * at its start.
 */
__device__ void epx_notify_scan_tile(const epx__cuda_shape_t &s, const epx__cuda_notify_args_t &a,
                                     int32_t *expert_counts, int32_t *warp_totals,
                                     int32_t *running, int32_t *tile_counts, int tile,
                                     int64_t first, int64_t end, uint64_t seq)
{
    const int R = s.world_size, lane = epx_lane(), warp = epx_warp();
    unsigned long long *first_bad = &s.local->scan_first_bad;
    int bad = 0;
    for (int w = threadIdx.x; w < R; w += blockDim.x)
        tile_counts[w] = 0;
    __syncthreads();
    uint64_t kept = 0;
    for (int64_t round = first; round < end; round += blockDim.x) {
        const int64_t t = round + threadIdx.x;
        kept = t < end ? epx_notify_mask(s, a, t, expert_counts, &bad, first_bad) : 0;
        for (int w = 0; w < R; w++) {
            const unsigned ballot = __ballot_sync(0xffffffffu, (kept >> w) & 1u);
            if (lane == 0 && ballot != 0)
                atomicAdd(&tile_counts[w], __popc(ballot));
        }
    }
    __syncthreads();

    epx__cuda_scan_tile_t *tiles = s.local->scan_tiles, *mine = &tiles[tile];
    if (warp == 0) {
        const uint64_t stamp = seq * 4;
        for (int w = lane; w < R; w += 32) {
            mine->aggregate[w] = tile_counts[w];
            if (tile == 0)
                mine->prefix[w] = tile_counts[w];
        }
        __threadfence();
        __syncwarp();
        if (lane == 0)
            *reinterpret_cast<volatile uint64_t *>(&mine->state) =
                stamp + (tile == 0 ? EPX_CUDA_SCAN_PREFIX : EPX_CUDA_SCAN_AGGREGATE);
        int32_t before[2] = {0, 0}; /* destinations lane and lane + 32 */
        for (int p = tile - 1; p >= 0; p--) {
            uint64_t state = lane == 0 ? epx_scan_tile_wait(s, &tiles[p], stamp) : 0;
            state = __shfl_sync(0xffffffffu, state, 0);
            __syncwarp(); /* orders the lanes' reads below after lane 0's acquire */
            if (state == 0)
                break; /* timed out (recorded): the kernel's results are not used */
            const bool prefix = state >= stamp + EPX_CUDA_SCAN_PREFIX;
            const volatile int32_t *v = prefix ? tiles[p].prefix : tiles[p].aggregate;
            for (int i = 0; i < 2; i++)
                if (lane + 32 * i < R)
                    before[i] += v[lane + 32 * i];
            if (prefix)
                break;
        }
        for (int i = 0; i < 2; i++) {
            const int w = lane + 32 * i;
            if (w < R) {
                running[w] = before[i];
                if (tile != 0)
                    mine->prefix[w] = before[i] + tile_counts[w];
            }
        }
        __threadfence();
        __syncwarp();
        if (lane == 0 && tile != 0)
            *reinterpret_cast<volatile uint64_t *>(&mine->state) = stamp + EPX_CUDA_SCAN_PREFIX;
    }
    __syncthreads();

    const bool one_round = end - first <= (int64_t)blockDim.x;
    for (int64_t round = first; round < end; round += blockDim.x) {
        const int64_t t = round + threadIdx.x;
        const uint64_t mask =
            one_round ? kept : (t < end ? epx_notify_mask(s, a, t, NULL, &bad, first_bad) : 0);
        epx_scan_round(mask, R, t < end ? a.send_row + t * R : NULL, warp_totals, running);
    }
}

/*
 * After every tile (the last block to finish, GPU scope: all of it is this rank's own
 * memory): this rank's totals per destination (the last tile's running total) and per
 * expert (summed over the tiles, then zeroed with the counters for the next scan), and
 * the lowest bad entry, now recorded. Returns nonzero in that block only.
 */
__device__ int epx_notify_scan_gather(const epx__cuda_shape_t &s, const epx__cuda_notify_args_t &a,
                                      int32_t *expert_counts, int32_t *running, int *last,
                                      int *any_bad)
{
    if (a.topk_idx != NULL)
        for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
            if (expert_counts[i] != 0)
                atomicAdd(&s.local->scan_experts[i], expert_counts[i]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        *last = atomicAdd(&s.local->scan_done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!*last)
        return 0;
    __threadfence();
    if (a.topk_idx != NULL) {
        for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
            expert_counts[i] = atomicExch(&s.local->scan_experts[i], 0);
    }
    const volatile int32_t *total = s.local->scan_tiles[gridDim.x - 1].prefix;
    for (int w = threadIdx.x; w < s.world_size; w += blockDim.x)
        running[w] = total[w];
    if (threadIdx.x == 0) {
        s.local->scan_done = 0;
        s.local->scan_ticket = 0;
        const unsigned long long entry = atomicExch(&s.local->scan_first_bad, ~0ull);
        if (entry != ~0ull) {
            const int64_t k = s.num_topk, index = (int64_t)entry;
            epx_record_failure(s, EPX_CUDA_FAIL_EXPERT_ID, EPX_CUDA_STAGE_NOTIFY, s.rank, s.rank,
                               a.topk_idx[(index / k) * a.topk_stride + index % k], index, 0);
            *any_bad = 1;
        }
    }
    __syncthreads();
    return 1;
}

__global__ void __launch_bounds__(EPX_CUDA_NOTIFY_THREADS)
    epx_notify_kernel(epx__cuda_shape_t s, epx__cuda_notify_args_t a)
{
    extern __shared__ int32_t expert_counts[]; /* [E] */
    __shared__ int32_t warp_totals[32 * EPX_CUDA_MAX_RANKS];
    __shared__ int32_t running[EPX_CUDA_MAX_RANKS];
    __shared__ int32_t tile_counts[EPX_CUDA_MAX_RANKS];
    __shared__ int any_bad, tile, last, stop;
    /* One block may be launched early (epx__cuda_launch_notify): the kernel before it on
     * the stream (perhaps the last block of a combine or a dispatch, in its finish
     * exchange) ends first. */
    epx_wait_previous();
    const int R = s.world_size, me = s.rank;
    const uint64_t seq = epx_op_seq(s);
    const int parity = (int)(seq & 1u);
    /* The data kernel's token tickets start from zero (it reads them only after this
     * kernel has ended, whatever path this kernel takes). */
    if (blockIdx.x == 0 && threadIdx.x == 0)
        s.local->grid_counter[EPX_CUDA_COUNTER_DISPATCH_TOKENS] = 0;
    /* A buffer that already failed sends nothing: its peers were told by the abort word.
     * Read once a block, before it draws a ticket; every block sees the same, as this
     * kernel records a failure only in its last block (or after a tile's wait timed out,
     * when its peers are told). */
    if (threadIdx.x == 0) {
        stop = epx_failed(s);
        any_bad = 0;
        tile = stop ? 0 : (int)atomicAdd(&s.local->scan_ticket, 1u);
    }
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        expert_counts[i] = 0;
    for (int r = threadIdx.x; r < EPX_CUDA_MAX_RANKS; r += blockDim.x)
        running[r] = 0;
    __syncthreads();
    if (stop)
        return;
    const int fresh = a.topk_idx != NULL || a.is_token_in_rank != NULL;
    if (fresh) {
        /* Tiles of whole rounds, one a block (epx__cuda_scan_blocks sized the grid). */
        int64_t first = 0, end = 0;
        epx__cuda_scan_tile(a.num_tokens, gridDim.x, tile, &first, &end);
        epx_notify_scan_tile(s, a, expert_counts, warp_totals, running, tile_counts, tile, first,
                             end, seq);
        if (!epx_notify_scan_gather(s, a, expert_counts, running, &last, &any_bad))
            return;
        if (a.topk_idx == NULL) {
            for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
                expert_counts[i] = a.num_tokens_per_expert[i];
            __syncthreads();
        }
    } else if (threadIdx.x == 0) {
        s.local->scan_ticket = 0; /* one block */
    }
    /* Bad input is still exchanged, as a status: every rank then fails the same call. */
    epx_notify_send(s, a, expert_counts, running, any_bad, seq);

    for (int r = threadIdx.x; r < R; r += blockDim.x)
        epx_wait_flag(s, &epx_slot(s, me, r)->count_flag[parity], seq, EPX_CUDA_STAGE_NOTIFY, r);
    __syncthreads();
    /* The data kernel's blocks may take their SMs while the results below are written:
     * after every thread's waits (the barrier above), so none is held while a peer is
     * awaited (earlier, they crowded out the other ranks' count exchanges). */
    epx_let_next_start();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int status = *reinterpret_cast<volatile int32_t *>(&epx_slot(s, me, r)->status[parity]);
        if (status != 0 && r != me && !epx_failed(s))
            epx_record_failure(s, EPX_CUDA_FAIL_PEER_INPUT, EPX_CUDA_STAGE_NOTIFY, r, r, 0, 0, 0);
    }
    __syncthreads();
    if (epx_block_failed(s))
        return;

    if (fresh) {
        epx_notify_finish(s, a, seq);
    } else if (a.ticket != 0) {
        /* Cached mode: the counts are the handle's; copy them for the host. */
        for (int l = threadIdx.x; l < s.num_local_experts; l += blockDim.x)
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

extern "C" cudaError_t epx__cuda_launch_layout(const epx__cuda_shape_t *shape,
                                               const epx__cuda_layout_args_t *args, int num_sms,
                                               cudaStream_t stream)
{
    int64_t wanted = (args->num_tokens + EPX_CUDA_THREADS - 1) / EPX_CUDA_THREADS;
    int blocks = (int)(wanted < num_sms ? wanted : num_sms);
    if (blocks < 1)
        blocks = 1;
    size_t smem = (size_t)(shape->num_experts + shape->world_size) * sizeof(int32_t);
    epx_layout_kernel<<<blocks, EPX_CUDA_THREADS, smem, stream>>>(*shape, *args);
    return cudaGetLastError();
}

extern "C" cudaError_t epx__cuda_launch_notify(const epx__cuda_shape_t *shape,
                                               const epx__cuda_notify_args_t *args,
                                               cudaStream_t stream)
{
    size_t smem = (size_t)shape->num_experts * sizeof(int32_t);
    /* A fresh scan: a block per round of tokens, within the SM budget and the tiles. */
    const int fresh = args->topk_idx != NULL || args->is_token_in_rank != NULL;
    const int64_t blocks = fresh ? epx__cuda_scan_blocks(args->num_tokens, args->max_blocks) : 1;
    /* One block (a cached dispatch's, or a scan of few tokens) is launched early: placed
     * while the operation before it ends in its last block, so it takes one SM where that
     * operation has just freed all its others, and back-to-back dispatches start together
     * instead of on MPS's staircase (docs/PERFORMANCE.md, "Launched early: the low-latency
     * kernels and the one-block count exchange"). A scan of several blocks of 1024 threads
     * is launched plainly: placed early, they could hold SMs a late peer's blocks need. */
    if (blocks == 1)
        return epx_launch_early(epx_notify_kernel, dim3(1), dim3(EPX_CUDA_NOTIFY_THREADS), smem,
                                stream, *shape, *args);
    epx_notify_kernel<<<(int)blocks, EPX_CUDA_NOTIFY_THREADS, smem, stream>>>(*shape, *args);
    return cudaGetLastError();
}
