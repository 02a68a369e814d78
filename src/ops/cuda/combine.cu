/*
 * Combine kernel: the inverse route of dispatch, as a pull. Each home rank reads, for
 * each of its tokens, the row every receiving rank holds for it, straight out of that
 * rank's buffer (CUDA IPC), sums them in fp32 in registers in rank order (the order of
 * the reference), and writes one bf16 row to out_x. Each expert-output byte is read
 * once and each output byte written once.
 *
 * What the peers expose: their combine input x, somewhere in their shared allocation:
 * either the caller's x itself, when it lies in the buffer (written into the
 * combine-input region of epx_get_combine_input, or computed in place into the
 * dispatch receive view), or a copy the host side made into the receive region just
 * before this kernel. Each rank publishes (offset, row stride, rows) with its ready
 * flag; a reader adds the offset to its mapping of that rank's allocation. Top-k
 * weights, when combined, were copied into the combine-weights region.
 *
 * Roles: a one-block ready kernel publishes this rank's input and waits for every
 * peer's (so at most one block per rank spins, whatever the SM budget); it is launched
 * early (epx_launch_early), so after an operation whose finish exchange lets it (a
 * combine or a dispatch on this stream) it is already on an SM when that one ends, and
 * waits there for its end before it reads anything. In the pull
 * kernel every warp is a reducer: one token at a time (its first by index, the next by
 * ticket as it frees up, epx_ticket_take: a token has 1-8 source ranks), lanes split the
 * row into 16-byte vectors, kGroup sources x kUnroll vectors of loads in flight per lane.
 * The sums start from the caller's biases (DeepEP's bias_0 + bias_1) when given.
 *
 * Signals: the last block to finish stores the sequence number into every peer's done
 * flag and waits for everyone's: when the kernel ends nobody reads this rank's buffer
 * any more, so the next operation may overwrite it.
 *
 * This is the vector form of the pull (EPX_NORMAL_KERNELS=1, and the fallback of the
 * bulk-copy form in combine_bulk.cu).
 *
 * Buffer use: reads only; the row of a token at rank r is send_row[t][r] < rows of r's
 * x (checked; a short x is an error naming the rank, never an out-of-bounds read).
 *
 * Trace: with EPX_NORMAL_TRACE (s.trace set; trace.c) the ready kernel opens a record per
 * combine and both kernels stamp when their phases end (events in launch.h).
 */
#include "combine_order.cuh"
#include "reduce.cuh"
#include "signal.cuh"

#define EPX_COMBINE_WARPS (EPX_CUDA_THREADS / 32)

/* EPX_NORMAL_TRACE (launch.h): the current combine's record, NULL when not tracing. */
__device__ __forceinline__ unsigned long long *combine_trace(const epx__cuda_shape_t &s)
{
    if (s.trace == NULL)
        return NULL;
    const uint64_t call = *reinterpret_cast<volatile uint64_t *>(&s.trace[1]);
    return reinterpret_cast<unsigned long long *>(
        s.trace + 2 + (call % EPX_NORMAL_TRACE_CALLS) * EPX_NORMAL_TRACE_EVENTS);
}

/* One thread, the ready kernel's start: a new record, its first time stamped. */
__device__ __forceinline__ void combine_trace_start(const epx__cuda_shape_t &s)
{
    if (s.trace == NULL)
        return;
    const uint64_t call = s.trace[0]++;
    s.trace[1] = call;
    unsigned long long *e = combine_trace(s);
    for (int i = 0; i < EPX_NORMAL_TRACE_EVENTS; i++)
        e[i] = 0;
    e[EPX_NORMAL_TRACE_PULL_FIRST] = ~0ull;
    e[EPX_NORMAL_TRACE_ROWS_FIRST] = ~0ull;
    e[EPX_NORMAL_TRACE_READY_START] = epx_globaltimer();
}

/* One thread: the event's first time (atomicMin) and its last (atomicMax) in a pair. */
__device__ __forceinline__ void combine_trace_span(const epx__cuda_shape_t &s, int first)
{
    unsigned long long *e = combine_trace(s);
    if (e == NULL)
        return;
    const unsigned long long now = epx_globaltimer();
    atomicMin(&e[first], now);
    atomicMax(&e[first + 1], now);
}

__device__ __forceinline__ void combine_trace_at(const epx__cuda_shape_t &s, int event)
{
    unsigned long long *e = combine_trace(s);
    if (e != NULL)
        e[event] = epx_globaltimer();
}

/*
 * One block: publish where this rank's x is (offset, stride, rows) and that it is ready,
 * then wait until every peer has done the same. Kept out of the pull kernel so that at
 * most one block per rank ever spins here, whatever the SM budget.
 */
__global__ void __launch_bounds__(64) epx_combine_ready_kernel(epx__cuda_shape_t s,
                                                               epx__cuda_combine_args_t a)
{
    /* Launched early (epx_launch_early): the previous kernel on the stream (perhaps a
     * combine whose pull kernel still takes tickets) ends first. */
    epx_wait_previous();
    const int R = s.world_size, me = s.rank;
    const uint64_t seq = epx_op_seq(s);
    /* The pull kernel's token tickets start from zero (it reads them only after this
     * kernel has ended, at its epx_wait_previous). */
    if (threadIdx.x == 0) {
        s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE_TOKENS] = 0;
        combine_trace_start(s);
    }
    if (epx_block_failed(s))
        return;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        epx__cuda_slot_t *slot = epx_slot(s, r, me);
        slot->ready_offset = a.x_offset;
        slot->ready_region = a.x_region;
        slot->ready_stride = a.x_stride;
        slot->ready_rows = a.x_rows;
        epx_st_release_sys(&slot->ready_flag, seq); /* a release: covers the three above */
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        epx_wait_flag(s, &epx_slot(s, me, r)->ready_flag, seq, EPX_CUDA_STAGE_COMBINE_READY, r);
    /* Only now may the pull kernel's blocks take their SMs (a thread's trigger counts for
     * its whole block, hence the barrier: every thread has passed its wait). Triggered at
     * this kernel's start, they sat on their SMs while it waited for the peers, and with
     * several ranks on one GPU whose SM budgets add up to more than it has (8 ranks x 24
     * SMs on an H200), one rank's parked pull blocks could take the SMs a late peer
     * needed to publish its input: no progress until the timeout (docs/PERFORMANCE.md,
     * ninth session). The start trigger was 3-14 us faster than no early launch at 16
     * SMs a rank (fifth session); this form measured the same as it (sixth session). */
    __syncthreads();
    if (threadIdx.x == 0)
        combine_trace_at(s, EPX_NORMAL_TRACE_READY_DONE);
    epx_let_next_start();
}

/*
 * One token's output row from its n source rows (in rank order, one add each: the
 * reference's summation order): kGroup rows x kUnroll vectors of loads in flight a lane.
 * With kBiases the sums start from the caller's bias rows (DeepEP's bias_0 + bias_1),
 * else from zero.
 */
template <int kUnroll, int kGroup, bool kBiases>
__device__ __forceinline__ void combine_row(const epx__cuda_combine_args_t &a,
                                            const char *const *src, int n, int64_t t, char *out,
                                            int units, int lane)
{
    for (int i0 = 0; i0 < units; i0 += 32 * kUnroll) {
        float acc[kUnroll][8];
        if (kBiases) {
            epx_start_sums<kUnroll>(acc, a, t, 0, i0, units, lane);
        } else {
#pragma unroll
            for (int u = 0; u < kUnroll; u++)
#pragma unroll
                for (int e = 0; e < 8; e++)
                    acc[u][e] = 0.0f;
        }
        epx_add_rows<kUnroll, kGroup>(acc, src, n, i0, units, lane, 0);
        epx_store_sums<kUnroll>(out, a.out_align, acc, i0, units, lane);
    }
}

template <int kUnroll, int kGroup, bool kBiases>
__global__ void __launch_bounds__(EPX_CUDA_THREADS, 1)
    epx_combine_kernel(epx__cuda_shape_t s, epx__cuda_combine_args_t a)
{
    __shared__ const char *x_base[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_stride[EPX_CUDA_MAX_RANKS];
    __shared__ int64_t x_rows[EPX_CUDA_MAX_RANKS];
    __shared__ const char *src_row[EPX_COMBINE_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ const float *src_weights[EPX_COMBINE_WARPS][EPX_CUDA_MAX_RANKS];
    __shared__ int last;

    /* Launched early (epx_launch_early): the ready exchange first. */
    epx_wait_previous();
    const int R = s.world_size, K = s.num_topk, me = s.rank;
    const uint64_t seq = epx_op_seq(s);
    /* The ready exchange failed on this rank (or an earlier operation did). */
    if (epx_block_failed(s))
        return;
    if (threadIdx.x == 0)
        combine_trace_span(s, EPX_NORMAL_TRACE_PULL_FIRST);
    /* Every peer's input location, acquired by the ready kernel before this one. */
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        const volatile epx__cuda_slot_t *slot = epx_slot(s, me, r);
        x_base[r] = epx_peer_x(s, r, slot);
        x_stride[r] = slot->ready_stride;
        x_rows[r] = slot->ready_rows;
    }
    __syncthreads();

    const int lane = epx_lane(), warp = epx_warp();
    const int64_t units = s.hidden * 2 / 16;
    const int64_t first_warp = (int64_t)blockIdx.x * EPX_COMBINE_WARPS + warp;
    const int64_t num_warps = (int64_t)gridDim.x * EPX_COMBINE_WARPS;

    uint32_t *tickets = &s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE_TOKENS];
    uint32_t ticket = 0;
    for (int64_t t = first_warp; t < a.num_tokens; t = epx_ticket_token(ticket, num_warps)) {
        ticket = epx_ticket_take(tickets, lane);
        /* The lane's ranks lane and lane + 32 (EPX_CUDA_MAX_RANKS is 64). */
        int32_t rows[2];
        for (int h = 0; h < 2; h++) {
            const int r = lane + 32 * h;
            rows[h] = r < R ? a.send_row[t * R + r] : -1;
            if (rows[h] >= 0 && rows[h] >= x_rows[r]) {
                epx_record_failure(s, EPX_CUDA_FAIL_ROWS, EPX_CUDA_STAGE_COMBINE_READY, r, me,
                                   rows[h], x_rows[r], 1);
                rows[h] = -1;
            }
        }
        int at[2];
        const int n = epx_combine_places(a, K, s.num_local_experts, R, t, rows[0] >= 0,
                                         rows[1] >= 0, lane, &at[0], &at[1]);
        for (int h = 0; h < 2; h++) {
            const int r = lane + 32 * h;
            if (rows[h] >= 0) {
                src_row[warp][at[h]] = x_base[r] + (int64_t)rows[h] * x_stride[r];
                src_weights[warp][at[h]] = reinterpret_cast<const float *>(
                                               epx_peer(s, r) + s.off_combine_weights) +
                                           (int64_t)rows[h] * K;
            }
        }
        __syncwarp();

        char *out = static_cast<char *>(a.out_x) + t * a.out_stride;
        combine_row<kUnroll, kGroup, kBiases>(a, src_row[warp], n, t, out, (int)units, lane);

        if (a.has_weights) {
            for (int k = lane; k < K; k += 32) {
                float sum = 0.0f;
                for (int j = 0; j < n; j++)
                    sum += __ldcg(src_weights[warp][j] + k);
                a.out_weights[t * a.out_weights_stride + k] = sum;
            }
        }
        __syncwarp();
    }

    if (lane == 0)
        combine_trace_span(s, EPX_NORMAL_TRACE_ROWS_FIRST);
    if (!epx_last_block_reader(&s.local->grid_counter[EPX_CUDA_COUNTER_COMBINE], &last))
        return;
    if (threadIdx.x == 0)
        combine_trace_at(s, EPX_NORMAL_TRACE_DONE_START);
    epx_finish_exchange(s, offsetof(epx__cuda_slot_t, done_flag), seq, EPX_CUDA_STAGE_COMBINE_DONE);
    if (threadIdx.x == 0)
        combine_trace_at(s, EPX_NORMAL_TRACE_DONE_END);
}

extern "C" cudaError_t epx__cuda_launch_combine(const epx__cuda_shape_t *shape,
                                                const epx__cuda_combine_args_t *args,
                                                cudaStream_t stream)
{
    cudaError_t err =
        epx_launch_early(epx_combine_ready_kernel, dim3(1), dim3(64), 0, stream, *shape, *args);
    if (err != cudaSuccess)
        return err;
    if (args->kernels == EPX_CUDA_KERNELS_BULK) {
        int launched = 0;
        err = epx__cuda_launch_combine_bulk(shape, args, stream, &launched);
        if (err != cudaSuccess || launched)
            return err;
    }
    /* Loads in flight a lane (H200, 8 ranks, standard case, docs/PERFORMANCE.md,
     * 2026-12-04): 8 source rows x 2 vectors at 16 blocks a rank; at 8 blocks or fewer,
     * 6 rows x 3 vectors (a token has 5.25 source ranks on average there, so more of its
     * row in flight at once: 10% faster at 8 blocks, 1-3% slower at 16). The bias-free
     * forms skip the bias loads and their registers (2-6% faster than the bias-capable
     * one). Each uses at most 128 registers with no spills. */
    void (*kernel)(epx__cuda_shape_t, epx__cuda_combine_args_t) =
        args->bias[0] != NULL || args->bias[1] != NULL ? epx_combine_kernel<2, 8, true>
        : args->num_blocks <= 8                       ? epx_combine_kernel<3, 6, false>
                                                      : epx_combine_kernel<2, 8, false>;
    return epx_launch_early(kernel, dim3(args->num_blocks), dim3(EPX_CUDA_THREADS), 0, stream,
                            *shape, *args);
}
