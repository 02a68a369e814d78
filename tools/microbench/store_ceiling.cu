/*
 * epx_store_ceiling: what a number of SMs can write, in one process, with no routing,
 * no signals and no other process on the GPU: the ceiling under normal-mode dispatch's
 * access pattern (one source row read, written to 5.25 rows elsewhere on average) for a
 * given SM budget. Not part of the library: built beside it (`build-gpu/epx_store_ceiling`
 * after `scripts/gpu-check`), run alone on the GPU, no MPS (docs/PERFORMANCE.md, "What
 * the SMs can write").
 *
 * The standard case's bytes for all 8 ranks together: 32768 source rows of 14,336 bytes
 * (bf16 x 7168), each written to 5 rows (6 for every fourth row: 5.25 on average) of a
 * destination region, as a dispatch writes them into the ranks' receive regions. Each
 * pattern runs on B blocks of 512 threads (one block an SM), B = 8 ranks x an SM budget:
 *   copy:        every row read and written once (16-byte loads and stores, 8 in flight
 *                a lane): the floor's own pattern, through the SMs;
 *   stores:      only the fan-out's writes, from registers (no loads at all);
 *   bulk stores: only the writes, as TMA bulk copies of a row from shared memory (filled
 *                once), one thread a warp issuing them;
 *   fan-out:     the dispatch's copy: a warp reads a row (8 vectors a lane in flight) and
 *                writes it to its 5 or 6 destinations.
 * Each is timed over 5 launches (the median), bytes read + written over the time, and
 * against the copy engines' device-to-device copy of 2 GiB (read + write counted), the
 * bandwidth `epx bench` takes for its floor. The fan-out's floor fraction is the one
 * `epx bench` reports for the data kernel alone: (reads + writes) / copy bandwidth /
 * time.
 *
 *   epx_store_ceiling [BLOCKS ...]   (default 32 64 96 128)
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define EPX_MICROBENCH_NAME "epx_store_ceiling"
#include "check_cuda.h"

namespace {

constexpr int kRowBytes = 14336, kRows = 32768, kThreads = 512, kLaunches = 5;
constexpr int kUnits = kRowBytes / 16;

/* Destinations of row i: 5, or 6 for every fourth row. */
__host__ __device__ __forceinline__ int fanout_of(int64_t i)
{
    return (i & 3) == 0 ? 6 : 5;
}

/* Row i's j-th destination row: spread over the region as a dispatch's receivers are
 * (each destination a different eighth of the region). */
__host__ __device__ __forceinline__ int64_t dest_row(int64_t i, int j, int64_t per_eighth)
{
    return ((i + j) % 8) * per_eighth + i;
}

__global__ void __launch_bounds__(kThreads) copy_kernel(const int4 *src, int4 *dst, int64_t units)
{
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    int64_t u = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    for (; u + 7 * stride < units; u += 8 * stride) {
        int4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            v[k] = src[u + k * stride];
#pragma unroll
        for (int k = 0; k < 8; k++)
            dst[u + k * stride] = v[k];
    }
    for (; u < units; u += stride)
        dst[u] = src[u];
}

/* A warp per row (by warp index, strided), the row's units stored to each destination. */
__global__ void __launch_bounds__(kThreads) stores_kernel(char *dst, int64_t per_eighth)
{
    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
    const int4 v = make_int4(lane, 1, 2, 3);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
         i < kRows; i += warps) {
        const int n = fanout_of(i);
        for (int j = 0; j < n; j++) {
            int4 *row = reinterpret_cast<int4 *>(dst + dest_row(i, j, per_eighth) * kRowBytes);
#pragma unroll 4
            for (int u = lane; u < kUnits; u += 32)
                row[u] = v;
        }
    }
}

__global__ void __launch_bounds__(kThreads) bulk_stores_kernel(char *dst, int64_t per_eighth)
{
    extern __shared__ __align__(128) int4 tile[];
    for (int u = threadIdx.x; u < kUnits; u += kThreads)
        tile[u] = make_int4(u, 1, 2, 3);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if ((threadIdx.x & 31) != 0)
        return;
    const uint32_t from = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
         i < kRows; i += warps) {
        const int n = fanout_of(i);
        for (int j = 0; j < n; j++) {
            char *to = dst + dest_row(i, j, per_eighth) * kRowBytes;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to),
                         "r"(from), "r"(kRowBytes)
                         : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void __launch_bounds__(kThreads)
    fanout_kernel(const char *src, char *dst, int64_t per_eighth)
{
    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
         i < kRows; i += warps) {
        const int4 *row = reinterpret_cast<const int4 *>(src + i * kRowBytes);
        const int n = fanout_of(i);
        for (int u0 = 0; u0 < kUnits; u0 += 32 * 8) {
            int4 v[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int u = u0 + k * 32 + lane;
                if (u < kUnits)
                    v[k] = row[u];
            }
            for (int j = 0; j < n; j++) {
                int4 *out = reinterpret_cast<int4 *>(dst + dest_row(i, j, per_eighth) * kRowBytes);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    const int u = u0 + k * 32 + lane;
                    if (u < kUnits)
                        out[u] = v[k];
                }
            }
        }
    }
}

template <typename Launch> double median_ms(Launch launch)
{
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    launch(); /* warm-up */
    std::vector<float> ms;
    for (int i = 0; i < kLaunches; i++) {
        CHECK_CUDA(cudaEventRecord(a));
        launch();
        CHECK_CUDA(cudaEventRecord(b));
        CHECK_CUDA(cudaEventSynchronize(b));
        CHECK_CUDA(cudaGetLastError());
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CHECK_CUDA(cudaEventDestroy(a));
    CHECK_CUDA(cudaEventDestroy(b));
    return ms[ms.size() / 2];
}

} // namespace

int main(int argc, char **argv)
{
    std::vector<int> budgets;
    for (int i = 1; i < argc; i++)
        budgets.push_back(atoi(argv[i]));
    if (budgets.empty())
        budgets = {32, 64, 96, 128};

    int64_t writes = 0;
    for (int64_t i = 0; i < kRows; i++)
        writes += fanout_of(i);
    const int64_t per_eighth = kRows; /* rows per destination eighth: room for every i */
    const size_t src_bytes = static_cast<size_t>(kRows) * kRowBytes;
    const size_t dst_bytes = static_cast<size_t>(8) * per_eighth * kRowBytes;
    char *src = nullptr, *dst = nullptr;
    CHECK_CUDA(cudaMalloc(&src, src_bytes));
    CHECK_CUDA(cudaMalloc(&dst, dst_bytes));
    CHECK_CUDA(cudaMemset(src, 1, src_bytes));
    CHECK_CUDA(cudaMemset(dst, 0, dst_bytes));
    CHECK_CUDA(cudaFuncSetAttribute(bulk_stores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kRowBytes));

    /* The floor's bandwidth: the copy engines, 2 GiB device to device (read + write). */
    const size_t copy_bytes = std::min(dst_bytes, static_cast<size_t>(2) << 30);
    const double ce_ms = median_ms([&] {
        CHECK_CUDA(cudaMemcpyAsync(dst, dst + dst_bytes - copy_bytes / 2, copy_bytes / 2,
                                   cudaMemcpyDeviceToDevice));
    });
    const double ce_gbs = static_cast<double>(copy_bytes) / (ce_ms * 1e6);
    const double fan_bytes = static_cast<double>(kRows + writes) * kRowBytes;
    const double store_bytes = static_cast<double>(writes) * kRowBytes;
    const double copy_pass = static_cast<double>(src_bytes);
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    printf("# %s, %d SMs; copy engines (2 GiB, read + write): %.0f GB/s\n", prop.name,
           prop.multiProcessorCount, ce_gbs);
    printf("# the fan-out's floor: %.3f GB read + written, %.1f us at that bandwidth\n",
           fan_bytes / 1e9, fan_bytes / ce_gbs / 1e3);
    printf("# %6s %-12s %10s %9s %14s\n", "blocks", "pattern", "time_us", "GB/s", "of_copy_bw");
    for (int blocks : budgets) {
        struct {
            const char *name;
            double bytes;
            double ms;
        } rows[4];
        rows[0] = {"copy", 2 * copy_pass, median_ms([&] {
                       copy_kernel<<<blocks, kThreads>>>(reinterpret_cast<const int4 *>(src),
                                                         reinterpret_cast<int4 *>(dst),
                                                         static_cast<int64_t>(src_bytes / 16));
                   })};
        rows[1] = {"stores", store_bytes,
                   median_ms([&] { stores_kernel<<<blocks, kThreads>>>(dst, per_eighth); })};
        rows[2] = {"bulk_stores", store_bytes, median_ms([&] {
                       bulk_stores_kernel<<<blocks, kThreads, kRowBytes>>>(dst, per_eighth);
                   })};
        rows[3] = {"fanout", fan_bytes,
                   median_ms([&] { fanout_kernel<<<blocks, kThreads>>>(src, dst, per_eighth); })};
        for (const auto &r : rows) {
            const double gbs = r.bytes / (r.ms * 1e6);
            printf("  %6d %-12s %10.1f %9.0f %14.3f\n", blocks, r.name, r.ms * 1e3, gbs,
                   gbs / ce_gbs);
        }
    }
    CHECK_CUDA(cudaFree(src));
    CHECK_CUDA(cudaFree(dst));
    return 0;
}
