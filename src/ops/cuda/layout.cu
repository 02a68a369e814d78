/*
 * Layout and count exchange: the small kernels that run before any token row moves.
 *
 * epx_layout_kernel (get_dispatch_layout): reads topk_idx only. Each block counts its
 * tokens per rank and per expert in shared memory and adds them to the outputs with
 * one atomic per counter; is_token_in_rank is written per token. Purely local.
 *
 * epx_notify_kernel (first kernel of every dispatch): one block of 1024 threads.
 *   1. Fresh mode: for each token the set of destination ranks (from topk_idx, or the
 *      caller's is_token_in_rank bits, whose per-expert counts then come from the
 *      caller's num_tokens_per_expert instead of being counted) and its ordinal among
 *      this rank's tokens to each destination (a block-wide scan, 1024 tokens a round,
 *      warp ballots + per-warp totals scanned by one warp's shuffles), written to the
 *      handle's send_row (16-byte stores), counts per rank and per expert. A token's ids
 *      are loaded at once (notify.cuh), so each round waits for memory once. Expert ids
 *      out of range are recorded, never followed.
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
 * int32 per rank); shared memory is E + 33 * 64 int32.
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

__global__ void __launch_bounds__(EPX_CUDA_NOTIFY_THREADS)
    epx_notify_kernel(epx__cuda_shape_t s, epx__cuda_notify_args_t a)
{
    extern __shared__ int32_t expert_counts[]; /* [E] */
    __shared__ int32_t warp_totals[32 * EPX_CUDA_MAX_RANKS];
    __shared__ int32_t running[EPX_CUDA_MAX_RANKS];
    __shared__ int any_bad;
    const int R = s.world_size, me = s.rank;
    const uint64_t seq = epx_op_seq(s);
    const int parity = (int)(seq & 1u);
    /* A buffer that already failed sends nothing: its peers were told by the abort word. */
    if (epx_failed(s))
        return;

    if (threadIdx.x == 0)
        any_bad = 0;
    for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
        expert_counts[i] = 0;
    for (int r = threadIdx.x; r < EPX_CUDA_MAX_RANKS; r += blockDim.x)
        running[r] = 0;
    __syncthreads();
    const int fresh = a.topk_idx != NULL || a.is_token_in_rank != NULL;
    if (a.topk_idx == NULL && a.is_token_in_rank != NULL) {
        for (int i = threadIdx.x; i < s.num_experts; i += blockDim.x)
            expert_counts[i] = a.num_tokens_per_expert[i];
        __syncthreads();
    }
    if (fresh) {
        int bad = 0;
        epx_notify_scan(s, a, expert_counts, warp_totals, running, &bad);
        if (bad)
            any_bad = 1;
        __syncthreads();
    }
    /* Bad input is still exchanged, as a status: every rank then fails the same call. */
    epx_notify_send(s, a, expert_counts, running, any_bad, seq);

    for (int r = threadIdx.x; r < R; r += blockDim.x)
        epx_wait_flag(s, &epx_slot(s, me, r)->count_flag[parity], seq, EPX_CUDA_STAGE_NOTIFY, r);
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int status = *reinterpret_cast<volatile int32_t *>(&epx_slot(s, me, r)->status[parity]);
        if (status != 0 && r != me && !epx_failed(s))
            epx_record_failure(s, EPX_CUDA_FAIL_PEER_INPUT, EPX_CUDA_STAGE_NOTIFY, r, r, 0, 0, 0);
    }
    __syncthreads();
    if (epx_failed(s))
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
    epx_notify_kernel<<<1, EPX_CUDA_NOTIFY_THREADS, smem, stream>>>(*shape, *args);
    return cudaGetLastError();
}
