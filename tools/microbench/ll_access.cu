/*
 * epx_ll_access: the low-latency kernels' memory access, alone, to measure what the GPU
 * gives that pattern (docs/PERFORMANCE.md, "Peers' memory vs own memory"). Not part of
 * the library; scripts/gpu-ll-access builds it and runs RANKS processes of it on one GPU
 * under MPS.
 *
 * Each process owns a region laid out like a rank's low-latency rows (32 experts x 1024
 * rows of 14,336 bytes) and maps every other process's through CUDA IPC. Its 128 tokens
 * each pick 8 distinct experts of the 32 x RANKS (a seeded draw). Patterns, each timed
 * over 300 launches of ACCESS_BLOCKS blocks (default 16), reading or writing either the
 * process's own region or the experts' owners' (the same offsets):
 *   gather:  the combine's receive: a warp takes a (token, 512-byte piece) unit, loads
 *            the piece of the token's 8 rows (16 bytes a lane each) and stores their
 *            integer sum; "1 unit" keeps 8 loads a lane in flight, "2 units" 16 (512
 *            threads a block);
 *   scatter: the dispatch's send: a warp loads 512 bytes of a 7,168-byte source row and
 *            stores them to the token's 8 rows; 4 such loads a lane in flight;
 *   gather as the combine: the combine receive's own loop (ll2_combine.cu,
 *            reduce_batch_loads) on bf16 rows: a warp takes a (token, 512-channel) unit,
 *            each lane 16 channels as two 16-byte pieces 256 channels apart, loads the
 *            unit's 8 rows (16 loads a lane) before it adds any, one fp32 fused
 *            multiply-add per channel and row with the row's weight, and stores bf16; the
 *            block's row addresses and weights are in shared memory first, as there;
 *            and the same with the next unit's loads issued before a unit is summed, in
 *            blocks of 256 threads (two units' registers do not fit 512: the same
 *            loads in flight per SM, half of them behind a sum);
 *   gather through a ring: the gather's units, but each lane's 8 loads are asynchronous
 *            copies (`cp.async`, 16 bytes) into a ring of S slots per warp in shared
 *            memory (192 KiB a block), the warp adding unit i while units i + 1 ..
 *            i + S - 1 are in flight, none held in registers: S = 3 with 16 warps a block
 *            (as many units in flight as "2 units": 32 a block), 6 with 8 warps (40), 12
 *            with 4 (44).
 *
 *   epx_ll_access RANK RANKS DIR   (DIR: a directory the processes share, for the IPC
 *                                   handles and the barriers between patterns)
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#define EPX_MICROBENCH_NAME "epx_ll_access"
#include "check_cuda.h"
#include "ops/cuda/device.cuh" /* the combine's sum, epx_bf16x8_fma */

namespace {

constexpr int kRowBytes = 14336, kFp8RowBytes = 7168, kTopk = 8, kTokens = 128;
constexpr int kLocalExperts = 32, kRowsPerExpert = 1024, kThreads = 512;
constexpr int kLaunches = 300;

/* The block's tokens: a contiguous range, as the low-latency kernels split them. */
__device__ __forceinline__ void block_tokens(int *t0, int *t1)
{
    const int per = (kTokens + gridDim.x - 1) / gridDim.x;
    *t0 = min(kTokens, (int)blockIdx.x * per);
    *t1 = min(kTokens, *t0 + per);
}

/* The gathers add the rows' 16-byte pieces as four integers. */
__device__ __forceinline__ void add_int4(int4 &sum, const int4 &v)
{
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
}

template <int kUnits>
__global__ void __launch_bounds__(kThreads) gather(const char *const *rows, char *out)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int pieces = kRowBytes / 512;
    int t0, t1;
    block_tokens(&t0, &t1);
    const int units = (t1 - t0) * pieces;
    for (int u0 = warp; u0 < units; u0 += warps * kUnits) {
        int4 v[kUnits][kTopk];
#pragma unroll
        for (int d = 0; d < kUnits; d++) {
            const int u = u0 + d * warps;
            if (u >= units)
                break;
            const int t = t0 + u / pieces, piece = u % pieces;
#pragma unroll
            for (int j = 0; j < kTopk; j++)
                v[d][j] = __ldcg(reinterpret_cast<const int4 *>(rows[t * kTopk + j] + piece * 512) + lane);
        }
#pragma unroll
        for (int d = 0; d < kUnits; d++) {
            const int u = u0 + d * warps;
            if (u >= units)
                break;
            const int t = t0 + u / pieces, piece = u % pieces;
            int4 sum = make_int4(0, 0, 0, 0);
#pragma unroll
            for (int j = 0; j < kTopk; j++)
                add_int4(sum, v[d][j]);
            reinterpret_cast<int4 *>(out + (size_t)t * kRowBytes + piece * 512)[lane] = sum;
        }
    }
}

__device__ __forceinline__ int4 to_bf16x8(const float *acc)
{
    int4 packed;
    __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(&packed);
#pragma unroll
    for (int i = 0; i < 8; i++)
        o[i] = __float2bfloat16_rn(acc[i]);
    return packed;
}

/* One (token, 512-channel) unit of gather_fma: its rows' two 16-byte pieces a lane. */
struct fma_unit_t {
    int4 lo[kTopk], hi[kTopk];
};

__device__ __forceinline__ void fma_load(fma_unit_t &v, const char *const *row, int u, int lane)
{
    constexpr int kChunks = kRowBytes / 2 / 512;
    const int entry = (u / kChunks) * kTopk, c0 = (u % kChunks) * 512 + lane * 8;
#pragma unroll
    for (int j = 0; j < kTopk; j++) {
        const int4 *r = reinterpret_cast<const int4 *>(row[entry + j]);
        v.lo[j] = __ldcg(r + c0 / 8);
        v.hi[j] = __ldcg(r + (c0 + 256) / 8);
    }
}

__device__ __forceinline__ void fma_sum(const fma_unit_t &v, const float *weight, int t0, int u,
                                        int lane, char *out)
{
    constexpr int kChunks = kRowBytes / 2 / 512;
    const int entry = (u / kChunks) * kTopk, c0 = (u % kChunks) * 512 + lane * 8;
    float acc0[8], acc1[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        acc0[i] = 0.0f;
        acc1[i] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kTopk; j++) {
        epx_bf16x8_fma(acc0, weight[entry + j], v.lo[j]);
        epx_bf16x8_fma(acc1, weight[entry + j], v.hi[j]);
    }
    char *o = out + (size_t)(t0 + u / kChunks) * kRowBytes;
    reinterpret_cast<int4 *>(o)[c0 / 8] = to_bf16x8(acc0);
    reinterpret_cast<int4 *>(o)[(c0 + 256) / 8] = to_bf16x8(acc1);
}

/* kAhead: also the next unit's loads in flight while a unit is summed, in blocks of half
 * the threads (two units' registers do not fit 512 threads: they would spill), so the
 * loads in flight per SM stay those of the plain form. */
template <bool kAhead>
__global__ void __launch_bounds__(kAhead ? kThreads / 2 : kThreads)
    gather_fma(const char *const *rows, const float *weights, char *out)
{
    constexpr int kChunks = kRowBytes / 2 / 512;
    constexpr int kMaxBlockEntries = kTokens * kTopk; /* a block may hold every token */
    __shared__ const char *row[kMaxBlockEntries];
    __shared__ float weight[kMaxBlockEntries];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int t0, t1;
    block_tokens(&t0, &t1);
    for (int i = threadIdx.x; i < (t1 - t0) * kTopk; i += blockDim.x) {
        row[i] = rows[t0 * kTopk + i];
        weight[i] = weights[t0 * kTopk + i];
    }
    __syncthreads();
    const int units = (t1 - t0) * kChunks;
    if (!kAhead) {
        for (int u = warp; u < units; u += warps) {
            fma_unit_t v;
            fma_load(v, row, u, lane);
            fma_sum(v, weight, t0, u, lane, out);
        }
        return;
    }
    /* Two units' registers in turn: unit u is summed while unit u + warps loads. */
    fma_unit_t a, b;
    if (warp < units)
        fma_load(a, row, warp, lane);
    for (int u = warp; u < units; u += 2 * warps) {
        const int v = u + warps;
        if (v < units)
            fma_load(b, row, v, lane);
        fma_sum(a, weight, t0, u, lane, out);
        if (v >= units)
            break;
        if (v + warps < units)
            fma_load(a, row, v + warps, lane);
        fma_sum(b, weight, t0, v, lane, out);
    }
}

__global__ void __launch_bounds__(kThreads) scatter(const char *x, char *const *rows)
{
    constexpr int kDepth = 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int pieces = kFp8RowBytes / 512;
    int t0, t1;
    block_tokens(&t0, &t1);
    const int items = (t1 - t0) * pieces;
    for (int i0 = warp; i0 < items; i0 += warps * kDepth) {
        int4 v[kDepth];
#pragma unroll
        for (int d = 0; d < kDepth; d++) {
            const int i = i0 + d * warps;
            if (i < items)
                v[d] = __ldg(reinterpret_cast<const int4 *>(x + (size_t)(t0 + i / pieces) * kFp8RowBytes +
                                                            (i % pieces) * 512) + lane);
        }
#pragma unroll
        for (int d = 0; d < kDepth; d++) {
            const int i = i0 + d * warps;
            if (i >= items)
                break;
            const int t = t0 + i / pieces, piece = i % pieces;
            for (int j = 0; j < kTopk; j++)
                reinterpret_cast<int4 *>(rows[t * kTopk + j] + piece * 512)[lane] = v[d];
        }
    }
}

__device__ __forceinline__ void cp_async16(void *smem, const void *global)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "l"(global)
                 : "memory");
}

/* Shared memory of a gather_async block: kWarps rings of kSlots units (8 pieces of 512 B). */
template <int kSlots, int kWarps>
constexpr size_t async_ring_bytes()
{
    return (size_t)kWarps * kSlots * kTopk * 512;
}

/* The gather's units through a ring of kSlots slots per warp (8 pieces of 512 B): the warp
 * adds unit i while units i + 1 .. i + kSlots - 1 are in flight. */
template <int kSlots, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) gather_async(const char *const *rows, char *out)
{
    extern __shared__ __align__(128) char ring[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = kWarps;
    const int pieces = kRowBytes / 512;
    int t0, t1;
    block_tokens(&t0, &t1);
    const int units = (t1 - t0) * pieces;
    char *slots = ring + (size_t)warp * kSlots * kTopk * 512;
    /* The warp's i-th unit into slot i % kSlots; one commit group each, empty past the
     * end, so that "all but the newest kSlots - 2 groups done" is unit i. */
    auto issue = [&](int i) {
        const int u = warp + i * warps;
        if (u < units) {
            const int t = t0 + u / pieces, piece = u % pieces;
            char *slot = slots + (size_t)(i % kSlots) * kTopk * 512;
#pragma unroll
            for (int j = 0; j < kTopk; j++)
                cp_async16(slot + j * 512 + lane * 16, rows[t * kTopk + j] + piece * 512 + lane * 16);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    const int mine = warp < units ? (units - warp + warps - 1) / warps : 0;
    for (int i = 0; i < kSlots - 1; i++)
        issue(i);
    for (int i = 0; i < mine; i++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(kSlots - 2) : "memory");
        const int u = warp + i * warps, t = t0 + u / pieces, piece = u % pieces;
        const char *slot = slots + (size_t)(i % kSlots) * kTopk * 512;
        int4 sum = make_int4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < kTopk; j++)
            add_int4(sum, *reinterpret_cast<const int4 *>(slot + j * 512 + lane * 16));
        reinterpret_cast<int4 *>(out + (size_t)t * kRowBytes + piece * 512)[lane] = sum;
        /* Into the slot unit i - 1 used (added one step ago). */
        issue(i + kSlots - 1);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

/* Launches a gather_async<kSlots, kWarps> over `blocks` blocks (its shared memory allowed
 * on the first call). */
template <int kSlots, int kWarps>
void launch_gather_async(int blocks, const char *const *rows, char *out)
{
    constexpr size_t bytes = async_ring_bytes<kSlots, kWarps>();
    static bool allowed = false;
    if (!allowed) {
        CHECK_CUDA(cudaFuncSetAttribute(gather_async<kSlots, kWarps>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        allowed = true;
    }
    gather_async<kSlots, kWarps><<<blocks, kWarps * 32, bytes>>>(rows, out);
}

/* Every process reaches `name` before any goes on (files in the shared directory). */
void barrier(const std::string &dir, const std::string &name, int rank, int ranks)
{
    const std::string prefix = dir + "/" + name + ".";
    FILE *f = fopen((prefix + std::to_string(rank)).c_str(), "w");
    if (f == NULL) {
        perror("epx_ll_access: barrier file");
        exit(1);
    }
    fclose(f);
    for (int waited_ms = 0;; waited_ms++) {
        int there = 0;
        for (int r = 0; r < ranks; r++)
            there += access((prefix + std::to_string(r)).c_str(), F_OK) == 0;
        if (there == ranks)
            return;
        if (waited_ms > 120000) {
            fprintf(stderr, "epx_ll_access: rank %d: the others never reached %s\n", rank,
                    name.c_str());
            exit(1);
        }
        usleep(1000);
    }
}

/* This process's region and every other's, mapped (index = rank). */
std::vector<char *> map_regions(char *mine, int rank, int ranks, const std::string &dir)
{
    cudaIpcMemHandle_t handle;
    CHECK_CUDA(cudaIpcGetMemHandle(&handle, mine));
    const std::string path = dir + "/handle.";
    FILE *f = fopen((path + std::to_string(rank)).c_str(), "wb");
    if (f == NULL || fwrite(&handle, sizeof handle, 1, f) != 1) {
        perror("epx_ll_access: handle file");
        exit(1);
    }
    fclose(f);
    barrier(dir, "handles", rank, ranks);
    std::vector<char *> base(ranks);
    for (int r = 0; r < ranks; r++) {
        if (r == rank) {
            base[r] = mine;
            continue;
        }
        f = fopen((path + std::to_string(r)).c_str(), "rb");
        if (f == NULL || fread(&handle, sizeof handle, 1, f) != 1) {
            fprintf(stderr, "epx_ll_access: rank %d: no handle from rank %d\n", rank, r);
            exit(1);
        }
        fclose(f);
        void *mapped = NULL;
        CHECK_CUDA(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess));
        base[r] = static_cast<char *>(mapped);
    }
    return base;
}

} // namespace

int main(int argc, char **argv)
{
    if (argc != 4 || atoi(argv[2]) < 1 || atoi(argv[1]) < 0 || atoi(argv[1]) >= atoi(argv[2])) {
        fprintf(stderr, "usage: epx_ll_access RANK RANKS DIR\n");
        return 2;
    }
    const int rank = atoi(argv[1]), ranks = atoi(argv[2]);
    const std::string dir = argv[3];
    const size_t region = (size_t)kLocalExperts * kRowsPerExpert * kRowBytes;
    char *mine, *out, *x, **rows_dev;
    float *weights;
    CHECK_CUDA(cudaMalloc(&mine, region));
    CHECK_CUDA(cudaMemset(mine, rank + 1, region));
    CHECK_CUDA(cudaMalloc(&out, (size_t)kTokens * kRowBytes));
    CHECK_CUDA(cudaMalloc(&x, (size_t)kTokens * kFp8RowBytes));
    CHECK_CUDA(cudaMemset(x, 3, (size_t)kTokens * kFp8RowBytes));
    CHECK_CUDA(cudaMalloc(&rows_dev, sizeof(char *) * kTokens * kTopk));
    {
        const std::vector<float> w(kTokens * kTopk, 0.125f);
        CHECK_CUDA(cudaMalloc(&weights, sizeof(float) * w.size()));
        CHECK_CUDA(cudaMemcpy(weights, w.data(), sizeof(float) * w.size(), cudaMemcpyHostToDevice));
    }
    const std::vector<char *> base = map_regions(mine, rank, ranks, dir);
    /* Blocks per launch: ACCESS_BLOCKS (default 16, the low-latency kernels' SM budget). */
    const char *blocks_env = getenv("ACCESS_BLOCKS");
    const int blocks = blocks_env != NULL && atoi(blocks_env) > 0 ? atoi(blocks_env) : 16;

    /* Token t's row for expert e: at row (rank * kTokens + t) of e's rows at its owner. */
    std::mt19937 draw(100 + rank);
    std::vector<char *> peer_rows(kTokens * kTopk), own_rows(kTokens * kTopk);
    for (int t = 0; t < kTokens; t++) {
        int chosen[kTopk];
        for (int j = 0; j < kTopk; j++) {
            int e, again;
            do {
                e = (int)(draw() % (uint32_t)(kLocalExperts * ranks));
                again = 0;
                for (int q = 0; q < j; q++)
                    again |= chosen[q] == e;
            } while (again);
            chosen[j] = e;
            const size_t offset =
                ((size_t)(e % kLocalExperts) * kRowsPerExpert + (size_t)rank * kTokens + t) * kRowBytes;
            peer_rows[t * kTopk + j] = base[e / kLocalExperts] + offset;
            own_rows[t * kTopk + j] = mine + offset;
        }
    }

    static const char *const names[] = {
        "gather, 1 unit (8 loads a lane), own memory  ", "gather, 1 unit (8 loads a lane), peers' memory",
        "gather, 2 units (16 loads a lane), own memory", "gather, 2 units (16 loads a lane), peers' memory",
        "scatter to 8 rows, own memory                ", "scatter to 8 rows, peers' memory             ",
        "gather, ring of 3 a warp x 16, own memory    ", "gather, ring of 3 a warp x 16, peers' memory ",
        "gather, ring of 6 a warp x 8, own memory     ", "gather, ring of 6 a warp x 8, peers' memory  ",
        "gather, ring of 12 a warp x 4, own memory    ", "gather, ring of 12 a warp x 4, peers' memory ",
        "gather as the combine (bf16 FMA), own memory ", "gather as the combine (bf16 FMA), peers' mem.",
        "as the combine, next unit ahead, own memory  ", "as the combine, next unit ahead, peers' mem. "};
    /* Patterns in pairs (own memory, then peers'), one pair per kind. */
    enum { kGather1, kGather2, kScatter, kGatherAsync, kGatherAsync6, kGatherAsync12, kGatherFma,
           kGatherFmaAhead, kKinds };
    for (int pattern = 0; pattern < 2 * kKinds; pattern++) {
        const int kind = pattern / 2;
        const std::vector<char *> &rows = pattern % 2 ? peer_rows : own_rows;
        CHECK_CUDA(cudaMemcpy(rows_dev, rows.data(), sizeof(char *) * rows.size(), cudaMemcpyHostToDevice));
        auto launch = [&]() {
            if (kind == kGather1)
                gather<1><<<blocks, kThreads>>>(rows_dev, out);
            else if (kind == kGather2)
                gather<2><<<blocks, kThreads>>>(rows_dev, out);
            else if (kind == kScatter)
                scatter<<<blocks, kThreads>>>(x, rows_dev);
            else if (kind == kGatherAsync)
                launch_gather_async<3, 16>(blocks, rows_dev, out);
            else if (kind == kGatherAsync6)
                launch_gather_async<6, 8>(blocks, rows_dev, out);
            else if (kind == kGatherAsync12)
                launch_gather_async<12, 4>(blocks, rows_dev, out);
            else if (kind == kGatherFma)
                gather_fma<false><<<blocks, kThreads>>>(rows_dev, weights, out);
            else
                gather_fma<true><<<blocks, kThreads / 2>>>(rows_dev, weights, out);
        };
        for (int i = 0; i < 5; i++)
            launch();
        CHECK_CUDA(cudaDeviceSynchronize());
        barrier(dir, "start" + std::to_string(pattern), rank, ranks);
        cudaEvent_t begin, end;
        CHECK_CUDA(cudaEventCreate(&begin));
        CHECK_CUDA(cudaEventCreate(&end));
        CHECK_CUDA(cudaEventRecord(begin));
        for (int i = 0; i < kLaunches; i++)
            launch();
        CHECK_CUDA(cudaEventRecord(end));
        CHECK_CUDA(cudaEventSynchronize(end));
        CHECK_CUDA(cudaGetLastError());
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, begin, end));
        ms /= kLaunches;
        /* Bytes through memory per launch: rows read + outputs written, or source read +
         * rows written. */
        const double bytes = (double)kTokens * (kTopk + 1) * (kind == kScatter ? kFp8RowBytes : kRowBytes);
        printf("%d  rank %d  %s  %7.1f us  %6.0f GB/s  (x %d processes: %6.0f GB/s)\n", pattern + 1,
               rank, names[pattern], ms * 1e3, bytes / ms / 1e6, ranks, ranks * bytes / ms / 1e6);
        fflush(stdout);
        barrier(dir, "end" + std::to_string(pattern), rank, ranks);
    }
    return 0;
}
