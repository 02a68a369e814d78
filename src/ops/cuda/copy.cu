/*
 * Local row copies: dispatch results from the receive region into caller-owned output
 * tensors, and combine inputs from caller memory into the buffer (so peers can pull
 * them). Purely local: no signals, no waits.
 *
 * Roles: one warp per row (grid-stride), lanes over the row in units of the widest
 * type that the source, the destination, both pitches and the row length are aligned
 * to (16 bytes for every tensor the library allocates), 8 loads in flight per lane.
 * Rows narrower than a warp's units (top-k ids and weights, fp8 scales: 32-224 bytes)
 * are spread over the lanes instead, consecutive threads on consecutive units across
 * rows: one warp a row left most lanes idle and waited a memory latency per row.
 *
 * Rows copied: `rows`, or fewer when only the device knows how many rows are valid
 * (worst-case mode): then min(rows, *rows_device), read by each warp at its start.
 */
#include "device.cuh"
#include "launch.h"

/* Rows of fewer than 32 units: thread i of the grid copies units i, i + step, ... of the
 * rows laid end to end, kUnroll loads in flight. */
template <typename T, int kUnroll>
__device__ __forceinline__ void epx_copy_narrow_rows(const epx__cuda_copy_args_t &a, int64_t rows,
                                                     int64_t units)
{
    const int64_t total = rows * units;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < total;
         i0 += step * kUnroll) {
        T v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const int64_t i = i0 + u * step;
            if (i < total)
                v[u] = __ldcg(reinterpret_cast<const T *>(static_cast<const char *>(a.src) +
                                                          (i / units) * a.src_pitch) +
                              i % units);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const int64_t i = i0 + u * step;
            if (i < total)
                reinterpret_cast<T *>(static_cast<char *>(a.dst) + (i / units) * a.dst_pitch)
                    [i % units] = v[u];
        }
    }
}

template <typename T, int kUnroll>
__global__ void __launch_bounds__(EPX_CUDA_THREADS) epx_copy_kernel(epx__cuda_copy_args_t a)
{
    int64_t rows = a.rows;
    if (a.rows_device != NULL) {
        int64_t valid = *a.rows_device;
        rows = valid < rows ? valid : rows;
    }
    const int64_t units = a.row_bytes / (int64_t)sizeof(T);
    if (units < 32) {
        epx_copy_narrow_rows<T, kUnroll>(a, rows, units);
        return;
    }
    const int lane = epx_lane();
    const int64_t warps_per_block = blockDim.x >> 5;
    for (int64_t row = blockIdx.x * warps_per_block + epx_warp(); row < rows;
         row += gridDim.x * warps_per_block) {
        const T *src = reinterpret_cast<const T *>(static_cast<const char *>(a.src) +
                                                   row * a.src_pitch);
        T *dst = reinterpret_cast<T *>(static_cast<char *>(a.dst) + row * a.dst_pitch);
        /* kUnroll loads in flight per lane before the first store: a copy is bound by
         * how many bytes are in flight, not by instructions. */
        for (int64_t i0 = 0; i0 < units; i0 += 32 * kUnroll) {
            T v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                int64_t i = i0 + u * 32 + lane;
                if (i < units)
                    v[u] = __ldcg(src + i);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                int64_t i = i0 + u * 32 + lane;
                if (i < units)
                    dst[i] = v[u];
            }
        }
    }
}

/* Largest power of two (at most 16) dividing every address and length of the copy. */
static int epx_copy_unit(const epx__cuda_copy_args_t *a)
{
    uint64_t bits = (uint64_t)(uintptr_t)a->src | (uint64_t)(uintptr_t)a->dst |
                    (uint64_t)a->src_pitch | (uint64_t)a->dst_pitch | (uint64_t)a->row_bytes |
                    16u;
    return (int)(bits & (~bits + 1u));
}

extern "C" cudaError_t epx__cuda_launch_copy(const epx__cuda_copy_args_t *args, int num_sms,
                                             cudaStream_t stream)
{
    if (args->rows <= 0 || args->row_bytes <= 0)
        return cudaSuccess;
    const int64_t warps = EPX_CUDA_THREADS / 32;
    int64_t wanted = (args->rows + warps - 1) / warps;
    int blocks = (int)(wanted < num_sms ? wanted : num_sms);
    switch (epx_copy_unit(args)) {
    case 16:
        epx_copy_kernel<int4, 8><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*args);
        break;
    case 8:
        epx_copy_kernel<int2, 8><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*args);
        break;
    case 4:
        epx_copy_kernel<int, 8><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*args);
        break;
    case 2:
        epx_copy_kernel<short, 8><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*args);
        break;
    default:
        epx_copy_kernel<char, 8><<<blocks, EPX_CUDA_THREADS, 0, stream>>>(*args);
        break;
    }
    return cudaGetLastError();
}
