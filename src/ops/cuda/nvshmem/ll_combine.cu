/*
 * Low-latency combine kernels (docs/LOW_LATENCY.md; src/ops/host/host_ll_combine.c is
 * the oracle they match).
 *
 * Two ways, chosen per buffer:
 * - pull (every peer reachable by a pointer: NVLink, or ranks sharing a GPU): each
 *   byte moves once. Send waits until the home ranks released this slot's previous
 *   combine, copies x into the symmetric combine input unless x already is it (the
 *   zero-copy view), and raises the combine flags: "my expert outputs are ready". The
 *   home rank's receive reads each row where it lies: at the expert's rank, combine
 *   input [local expert][begin of this rank's rows there + the row's place in them]
 *   (recv_range of that rank, send_pos of this one).
 * - push (some peer needs NVSHMEM puts): send puts each row of x into its home rank's
 *   combine staging at [source token][top-k position]; the receive reads it locally.
 * Receive (a warp takes a token's top-k entries once, then chunks of 256 channels):
 * wait for the expert ranks' flags, out = bf16(sum over j of w_j * y_j) in fp32, one
 * fused multiply-add per entry in j order (fmaf on the host), entries on
 * masked ranks skipped; the last block releases the slot to the expert ranks.
 * The send's last block also gives the step's dispatch results back (ll_device.cuh).
 */
#include <cuda_bf16.h>

#include "ops/cuda/nvshmem/ll_device.cuh"

/* Expert rows a combine receive lane loads before it sums them. */
#define EPX_LL_BATCH 8

static __device__ __forceinline__ void epx_ll_combine_send(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int32_t smem[];
    int32_t *ok = smem;                   /* [R] */
    int32_t *expert_first = smem + s.world; /* [L + 1] */
    __shared__ int last;
    const int R = s.world, k = s.topk, slot = op.slot, lane = threadIdx.x & 31,
              warp = threadIdx.x >> 5;
    const uint64_t seq = epx_ll_seq(s, slot, 1) + 1;
    epx_ll_wait_peers(s, EPX_LL_KIND_COMBINE_DONE, slot, seq - 1, EPX_LL_STAGE_COMBINE_RELEASE,
                      ok);

    const size_t slot_base = s.slot[slot], row_bytes = (size_t)s.hidden * 2;
    char *own = s.sym + slot_base;
    const char *in = s.local[slot];
    const char *x = reinterpret_cast<const char *>(op.x);
    const int in_place = x == own + s.combine_in;

    /* The warps of the grid share all received rows evenly. */
    const int L = s.num_local, warps = gridDim.x * EPX_LL_WARPS;
    const int32_t *recv_count = reinterpret_cast<const int32_t *>(in + s.recv_count);
    if (threadIdx.x == 0) {
        int32_t pos = 0;
        for (int e = 0; e < L; e++) {
            expert_first[e] = pos;
            pos += recv_count[e];
        }
        expert_first[L] = pos;
    }
    __syncthreads();
    /* Pull with x already in place (the zero-copy view): nothing to move, only the
     * flags below. */
    const int64_t rows_to_move = !s.use_puts && in_place ? 0 : expert_first[L];
    for (int g = blockIdx.x * EPX_LL_WARPS + warp; g < rows_to_move; g += warps) {
        {
            const int e = epx_ll_find(expert_first, L, g);
            const int i = g - expert_first[e];
            const int64_t row = (int64_t)e * s.rows + i;
            const int home_rank = reinterpret_cast<const int32_t *>(in + s.recv_src_rank)[row];
            if (!ok[home_rank])
                continue;
            const char *from = x + (size_t)row * row_bytes;
            if (!s.use_puts) {
                /* Pull: the home ranks read the rows from the combine input. */
                if (!in_place)
                    epx_ll_warp_copy(own + s.combine_in + (size_t)row * row_bytes, from,
                                     row_bytes, lane);
                continue;
            }
            const int64_t token = reinterpret_cast<const int32_t *>(own + s.recv_src_info)[row];
            const int64_t j = reinterpret_cast<const int32_t *>(own + s.recv_topk)[row];
            const size_t dst = slot_base + s.combine_stage + (size_t)(token * k + j) * row_bytes;
            char *home = s.peer[home_rank];
            if (home != NULL) {
                epx_ll_warp_copy(home + dst, from, row_bytes, lane);
            } else {
                /* Puts read symmetric memory: stage rows of a caller's tensor first. */
                char *staged = own + s.combine_in + (size_t)row * row_bytes;
                if (!in_place) {
                    epx_ll_warp_copy(staged, from, row_bytes, lane);
                    __syncwarp();
                }
                nvshmemx_putmem_nbi_warp(s.sym + dst, staged, row_bytes, home_rank);
            }
        }
    }

    if (!epx_ll_last_block(s, s.arrive + slot * 4 + EPX_LL_ARRIVE_COMBINE_SEND, &last))
        return;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (ok[r])
            epx_ll_signal(s, r, EPX_LL_KIND_COMBINE, slot, seq);
    /* The step's dispatch results are no longer needed here: the sources may reuse the
     * slot (they also wait for this combine before their next dispatch into it). */
    epx_ll_give_back(s, slot, epx_ll_seq(s, slot, 0));
    if (threadIdx.x == 0)
        s.seq[slot * 2 + 1] = seq;
}

/*
 * Top-k entry j of token t for the reduction: where its expert's output row lies and
 * the weight, or NULL for -1 entries, entries on masked ranks and j >= k. A token sent
 * one row per distinct expert, at the first top-k position naming it.
 */
__device__ __forceinline__ void epx_ll_entry(const epx_ll_shape_t &s, const epx_ll_op_t &op,
                                             int64_t t, int j, const int32_t *ok,
                                             const char **row, float *weight)
{
    *row = NULL;
    *weight = 0.0f;
    const int k = s.topk, L = s.num_local;
    if (j >= k)
        return;
    const int64_t *idx = op.topk_idx + t * op.idx_stride;
    const int64_t e = epx_ll_expert_or_none(s, EPX_LL_STAGE_COMBINE, t * k + j, idx[j]);
    if (e < 0)
        return;
    const int r = (int)(e / L);
    if (!ok[r])
        return;
    int first = 0;
    while (idx[first] != e)
        first++;
    *weight = op.weights[t * op.weight_stride + j];
    const size_t row_bytes = (size_t)s.hidden * 2, slot_base = s.slot[op.slot];
    if (s.use_puts) {
        *row = s.sym + slot_base + s.combine_stage + (size_t)(t * k + first) * row_bytes;
        return;
    }
    /* Pull: this rank's rows at rank r start at recv_range's begin for (expert, me). */
    const char *peer = s.peer[r] + slot_base;
    const int local = (int)(e % L);
    const uint64_t range =
        epx_ld_volatile_u64(reinterpret_cast<const uint64_t *>(peer + s.recv_range) +
                            (size_t)local * s.world + s.rank);
    const int32_t pos = reinterpret_cast<const int32_t *>(s.local[op.slot] + s.send_pos)[t * k + first];
    *row = peer + s.combine_in + ((size_t)local * s.rows + (range >> 32) + pos) * row_bytes;
}

static __device__ __forceinline__ void epx_ll_combine_recv(epx_ll_shape_t s, epx_ll_op_t op)
{
    extern __shared__ int32_t ok[]; /* [R] */
    __shared__ int last;
    const int R = s.world, k = s.topk, slot = op.slot, lane = threadIdx.x & 31;
    const uint64_t seq = epx_ll_seq(s, slot, 1);
    epx_ll_wait_peers(s, EPX_LL_KIND_COMBINE, slot, seq, EPX_LL_STAGE_COMBINE, ok);

    /* 32-bit indices (tokens <= M, hidden < 2^31 / 256): fewer registers. */
    const int chunks = (int)((s.hidden + 255) / 256), tokens = (int)op.tokens;
    const int warps = (int)gridDim.x * EPX_LL_WARPS;
    /* A warp takes one token and every parts-th chunk of it (all warps busy). */
    int parts = tokens > 0 ? warps / tokens : 1;
    parts = parts < 1 ? 1 : (parts > chunks ? chunks : parts);
    for (int item = (int)blockIdx.x * EPX_LL_WARPS + (int)(threadIdx.x >> 5); item < tokens * parts;
         item += warps) {
        const int t = item / parts;
        /* Lane j's entry: the row it reads, or NULL when it adds nothing, and its
         * weight. Computed once when k <= 32. */
        const char *my_row = NULL;
        float my_weight = 0.0f;
        if (k <= 32)
            epx_ll_entry(s, op, t, lane, ok, &my_row, &my_weight);
        for (int c = item % parts; c < chunks; c += parts) {
            const int channel = c * 256 + lane * 8;
            float acc[8];
            for (int i = 0; i < 8; i++)
                acc[i] = 0.0f;
            for (int j0 = 0; j0 < k; j0 += 32) {
                const char *row = my_row;
                float weight = my_weight;
                if (k > 32)
                    epx_ll_entry(s, op, t, j0 + lane, ok, &row, &weight);
                const int n = k - j0 < 32 ? k - j0 : 32;
                /* Up to EPX_LL_BATCH rows in flight, then summed in j order. Entries
                 * that add nothing load zeros with weight 0: adding +0 leaves the sum
                 * as it is (it is never -0), so it equals skipping them. Only the
                 * loaded vectors are kept (registers). */
                for (int b0 = 0; b0 < n; b0 += EPX_LL_BATCH) {
                    int4 raw[EPX_LL_BATCH];
#pragma unroll
                    for (int b = 0; b < EPX_LL_BATCH; b++) {
                        const char *src = reinterpret_cast<const char *>(__shfl_sync(
                            0xffffffffu, reinterpret_cast<unsigned long long>(row),
                            b0 + b < n ? b0 + b : 0));
                        raw[b] = make_int4(0, 0, 0, 0);
                        if (b0 + b < n && src != NULL && channel < s.hidden)
                            raw[b] = epx_ld_nc_v4(src + channel * 2);
                    }
#pragma unroll
                    for (int b = 0; b < EPX_LL_BATCH; b++) {
                        const float w = __shfl_sync(0xffffffffu, weight, b0 + b < n ? b0 + b : 0);
                        if (b0 + b >= n)
                            continue;
                        epx_bf16x8_fma(acc, w, raw[b]);
                    }
                }
            }
            if (channel >= s.hidden)
                continue;
            int4 packed;
            __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(&packed);
            for (int i = 0; i < 8; i++)
                o[i] = __float2bfloat16_rn(acc[i]);
            epx_st_v4(reinterpret_cast<char *>(op.out) + ((size_t)t * op.out_stride + channel) * 2,
                      packed);
        }
    }

    if (!epx_ll_last_block(s, s.arrive + slot * 4 + EPX_LL_ARRIVE_COMBINE_RECV, &last))
        return;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        if (ok[r])
            epx_ll_signal(s, r, EPX_LL_KIND_COMBINE_DONE, slot, seq);
}

/*
 * The one kernel of a low-latency combine, for its send and its receive phase alike, so that
 * a profiler lists one "combine" kernel, as for DeepEP (whose tests time its kernels by
 * name): the phases are the two launches of it.
 */
namespace epx {
namespace ll {
__global__ void __launch_bounds__(EPX_LL_THREADS) combine(epx_ll_shape_t s, epx_ll_op_t op, int phase)
{
    if (phase == EPX_LL_PHASE_SEND)
        epx_ll_combine_send(s, op);
    else
        epx_ll_combine_recv(s, op);
}
} // namespace ll
} // namespace epx

extern "C" int epx_ll_launch_combine_send(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                          void *stream)
{
    size_t smem = ((size_t)s->world + (size_t)s->num_local + 1) * sizeof(int32_t);
    epx::ll::combine<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op, EPX_LL_PHASE_SEND);
    return (int)cudaGetLastError();
}

extern "C" int epx_ll_launch_combine_recv(const epx_ll_shape_t *s, const epx_ll_op_t *op,
                                          void *stream)
{
    size_t smem = (size_t)s->world * sizeof(int32_t);
    epx::ll::combine<<<s->blocks, EPX_LL_THREADS, smem, (cudaStream_t)stream>>>(*s, *op, EPX_LL_PHASE_RECV);
    return (int)cudaGetLastError();
}
