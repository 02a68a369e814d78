/*
 * The fan-in sum of normal-mode combine alone (epx_fanin_reduce, include/epx_tool.h), for
 * the fan-in rows of `epx bench --mode fanout`: how fast combine's access pattern can go
 * on the machine, with the same SM budget and the same loads in flight as the vector
 * combine kernel (combine.cu), and none of its routing, ready exchange or done flags.
 *
 * What moves: output row i is the fp32 sum of the bf16 rows at row first_row + i of the
 * combine-input regions of ranks (rank + i + j) mod R for j < k_i (read through the CUDA
 * IPC mapping, as combine reads its peers' x), added in j order from 0.0f and rounded to
 * bf16 once, into dst + i * dst_pitch (this rank's memory). Each source byte is read once,
 * each output byte written once.
 *
 * Roles: every warp of a block of EPX_CUDA_THREADS is a reducer, as in the combine
 * kernel: one row at a time (its first by index, the next by ticket as it frees up:
 * rows have 5 or 6 sources at fanin 5.25), lanes split the row into 16-byte vectors,
 * kGroup source rows x kUnroll vectors of loads in flight per lane, then the adds
 * (reduce.cuh, the combine kernels' own row loop). The launcher picks kUnroll and kGroup
 * by the blocks launched the way epx__cuda_launch_combine does, so a row of this kernel
 * is the ceiling of that kernel at the same SM budget.
 *
 * Signals: none, and no waits. The caller orders the sum against everything else
 * (barriers, stream synchronisation): the peers' rows must be in place before it starts.
 *
 * Buffer use: reads the peers' combine-input regions only; the ticket counter
 * EPX_CUDA_COUNTER_FANOUT_ROWS is shared with the fan-out copy (never run at the same
 * time on a buffer).
 */
#include "epx_tool.h"

#include "reduce.cuh"
#include "signal.cuh"

#define EPX_FANIN_WARPS (EPX_CUDA_THREADS / 32)

template <int kUnroll, int kGroup>
__global__ void __launch_bounds__(EPX_CUDA_THREADS, 1)
    epx_fanin_vector_kernel(epx__cuda_shape_t s, epx__cuda_fanin_args_t a)
{
    __shared__ char *peers[EPX_CUDA_MAX_RANKS];
    __shared__ const char *src_row[EPX_FANIN_WARPS][EPX_CUDA_MAX_RANKS];
    const int R = s.world_size;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        peers[r] = epx_peer(s, r);
    __syncthreads();

    const int lane = epx_lane(), warp = epx_warp();
    const int64_t units = a.row_bytes / 16;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * EPX_FANIN_WARPS;
    uint32_t *tickets = &s.local->grid_counter[EPX_CUDA_COUNTER_FANOUT_ROWS];
    uint32_t ticket = 0;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * EPX_FANIN_WARPS + warp; i < a.rows;
         i = epx_ticket_token(ticket, num_warps)) {
        ticket = epx_ticket_take(tickets, lane);
        const int count = epx_fanout_count(i, a.fanin_milli);
        const int64_t offset = a.src_offset + (a.first_row + i) * a.src_pitch;
        /* The row's sources in j order (count <= R <= EPX_CUDA_MAX_RANKS). */
        for (int j = lane; j < count; j += 32)
            src_row[warp][j] = peers[(s.rank + i + j) % R] + offset;
        __syncwarp();
        char *out = static_cast<char *>(a.dst) + i * a.dst_pitch;
        for (int64_t i0 = 0; i0 < units; i0 += 32 * kUnroll) {
            float acc[kUnroll][8];
#pragma unroll
            for (int u = 0; u < kUnroll; u++)
#pragma unroll
                for (int e = 0; e < 8; e++)
                    acc[u][e] = 0.0f;
            epx_add_rows<kUnroll, kGroup>(acc, src_row[warp], count, i0, units, lane, 0);
            epx_store_sums<kUnroll>(out, 16, acc, i0, units, lane);
        }
        /* Every lane has read this row's sources before the next row's replace them. */
        __syncwarp();
    }
}

extern "C" cudaError_t epx__cuda_launch_fanin(const epx__cuda_shape_t *shape,
                                              const epx__cuda_fanin_args_t *args,
                                              cudaStream_t stream)
{
    if (args->kernel != EPX_FANIN_VECTOR)
        return cudaErrorInvalidValue;
    if (args->rows <= 0)
        return cudaSuccess;
    const int64_t wanted = (args->rows + EPX_FANIN_WARPS - 1) / EPX_FANIN_WARPS;
    const int blocks = static_cast<int>(wanted < args->num_sms ? wanted : args->num_sms);
    cudaError_t err = cudaMemsetAsync(&shape->local->grid_counter[EPX_CUDA_COUNTER_FANOUT_ROWS],
                                      0, sizeof(uint32_t), stream);
    if (err != cudaSuccess)
        return err;
    /* The combine kernel's loads in flight for the same number of blocks (combine.cu:
     * 6 source rows x 3 vectors a lane on 8 blocks or fewer, else 8 x 2). */
    if (blocks <= 8)
        epx_fanin_vector_kernel<3, 6><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*shape, *args);
    else
        epx_fanin_vector_kernel<2, 8><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*shape, *args);
    return cudaGetLastError();
}
