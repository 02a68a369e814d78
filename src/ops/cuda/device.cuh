/*
 * Memory access helpers shared by the CUDA kernels: vector loads and stores, memory
 * ordering at system scope, the global timer, bf16 conversion. Every kernel file uses
 * these instead of writing its own inline PTX.
 *
 * Scope: flags cross processes (CUDA IPC on one GPU under MPS, or NVLink peers), so
 * acquire/release and fences are at system scope. Bulk data goes through L2 only
 * (L1::no_allocate): a row written by a peer must never be served from a stale L1 line.
 */
#ifndef EPX_OPS_CUDA_DEVICE_CUH
#define EPX_OPS_CUDA_DEVICE_CUH

#include <stdint.h>

/* ---------------------------------------------------------------- ordering */

__device__ __forceinline__ uint64_t epx_ld_acquire_sys(const uint64_t *p)
{
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void epx_st_release_sys(uint64_t *p, uint64_t v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/*
 * A release-acquire fence at system scope (fence.acq_rel.sys): with a strong write after
 * it, a release of everything before it; with a strong read before it, an acquire.
 * __threadfence_system() is the sequentially consistent fence (fence.sc.sys), which
 * nothing here needs and which measured far dearer with 8 processes on one GPU: one per
 * low-latency combine cost 12 us a step (docs/PERFORMANCE.md).
 */
__device__ __forceinline__ void epx_fence_acq_rel_sys()
{
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}

/* The same at GPU scope (fence.acq_rel.gpu): orders this GPU's threads only. */
__device__ __forceinline__ void epx_fence_acq_rel_gpu()
{
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

/* A plain load that is never cached or merged by the compiler (polling). */
__device__ __forceinline__ uint64_t epx_ld_volatile_u64(const uint64_t *p)
{
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t epx_globaltimer(void)
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* ---------------------------------------------------------------- 16-byte vectors */

/* Read-only stream: no L1 allocation, 256-byte L2 prefetch (rows are long). */
__device__ __forceinline__ int4 epx_ld_nc_v4(const void *p)
{
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void epx_st_v4(void *p, int4 v)
{
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

/*
 * 16 bytes at an address aligned to `align` (16, 8, 4, 2 or 1; uniform across the
 * kernel, so the branch never diverges). User tensors may be views at odd offsets;
 * the library's own rows are always 16-byte aligned. The narrow paths assemble the
 * vector with shifts, never through its address, so it stays in registers.
 */
__device__ __forceinline__ uint32_t epx_ld_u32_bytes(const unsigned char *p, int align)
{
    if (align >= 2) {
        const unsigned short *q = reinterpret_cast<const unsigned short *>(p);
        return (uint32_t)__ldg(q) | ((uint32_t)__ldg(q + 1) << 16);
    }
    return (uint32_t)__ldg(p) | ((uint32_t)__ldg(p + 1) << 8) | ((uint32_t)__ldg(p + 2) << 16) |
           ((uint32_t)__ldg(p + 3) << 24);
}

__device__ __forceinline__ int4 epx_ld16(const void *p, int align)
{
    if (align >= 16)
        return epx_ld_nc_v4(p);
    if (align >= 8) {
        const uint2 *q = static_cast<const uint2 *>(p);
        uint2 a = __ldg(q), b = __ldg(q + 1);
        return make_int4((int)a.x, (int)a.y, (int)b.x, (int)b.y);
    }
    if (align >= 4) {
        const unsigned int *q = static_cast<const unsigned int *>(p);
        return make_int4((int)__ldg(q), (int)__ldg(q + 1), (int)__ldg(q + 2), (int)__ldg(q + 3));
    }
    const unsigned char *b = static_cast<const unsigned char *>(p);
    return make_int4((int)epx_ld_u32_bytes(b, align), (int)epx_ld_u32_bytes(b + 4, align),
                     (int)epx_ld_u32_bytes(b + 8, align), (int)epx_ld_u32_bytes(b + 12, align));
}

__device__ __forceinline__ void epx_st_u32_bytes(unsigned char *p, uint32_t v, int align)
{
    if (align >= 2) {
        unsigned short *q = reinterpret_cast<unsigned short *>(p);
        q[0] = (unsigned short)v;
        q[1] = (unsigned short)(v >> 16);
        return;
    }
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

__device__ __forceinline__ void epx_st16(void *p, int4 v, int align)
{
    if (align >= 16) {
        epx_st_v4(p, v);
        return;
    }
    if (align >= 8) {
        uint2 *q = static_cast<uint2 *>(p);
        q[0] = make_uint2((unsigned)v.x, (unsigned)v.y);
        q[1] = make_uint2((unsigned)v.z, (unsigned)v.w);
        return;
    }
    if (align >= 4) {
        unsigned int *q = static_cast<unsigned int *>(p);
        q[0] = (unsigned)v.x;
        q[1] = (unsigned)v.y;
        q[2] = (unsigned)v.z;
        q[3] = (unsigned)v.w;
        return;
    }
    unsigned char *b = static_cast<unsigned char *>(p);
    epx_st_u32_bytes(b, (uint32_t)v.x, align);
    epx_st_u32_bytes(b + 4, (uint32_t)v.y, align);
    epx_st_u32_bytes(b + 8, (uint32_t)v.z, align);
    epx_st_u32_bytes(b + 12, (uint32_t)v.w, align);
}

/* ---------------------------------------------------------------- row copies */

/*
 * The vector loop of every row copy: in a batch starting at unit i0, lane `lane` of a
 * warp handles the 16-byte units i0 + u * 32 + lane for u < kDepth (those below
 * `units`). Loading the whole batch before storing keeps kDepth vectors in flight per
 * lane: a copy is bound by the bytes in flight, not by instructions. The source may be
 * aligned to less than 16 bytes (`align`, see epx_ld16); the destination is the
 * library's own memory, always 16-byte aligned.
 */
template <int kDepth>
__device__ __forceinline__ void epx_ld16_batch(int4 (&v)[kDepth], const char *src, int64_t i0,
                                               int64_t units, int lane, int align)
{
#pragma unroll
    for (int u = 0; u < kDepth; u++) {
        const int64_t i = i0 + (int64_t)u * 32 + lane;
        if (i < units)
            v[u] = epx_ld16(src + i * 16, align);
    }
}

template <int kDepth>
__device__ __forceinline__ void epx_st16_batch(char *dst, const int4 (&v)[kDepth], int64_t i0,
                                               int64_t units, int lane)
{
#pragma unroll
    for (int u = 0; u < kDepth; u++) {
        const int64_t i = i0 + (int64_t)u * 32 + lane;
        if (i < units)
            epx_st_v4(dst + i * 16, v[u]);
    }
}

/* Copy `units` 16-byte vectors between 16-byte aligned rows, by one warp. */
template <int kDepth>
__device__ __forceinline__ void epx_warp_copy16(char *dst, const char *src, int64_t units,
                                                int lane)
{
    for (int64_t i0 = 0; i0 < units; i0 += 32 * kDepth) {
        int4 v[kDepth];
        epx_ld16_batch<kDepth>(v, src, i0, units, lane, 16);
        epx_st16_batch<kDepth>(dst, v, i0, units, lane);
    }
}

/* ---------------------------------------------------------------- waits and barriers */

/*
 * The spin of every flag wait: at most `spins` acquire loads of *flag; 1 once it is at
 * least `target`, 0 when the spins ran out (the caller then checks its own reasons to
 * give up, such as a timeout or a failed peer, and spins again).
 */
__device__ __forceinline__ int epx_spin_until(const uint64_t *flag, uint64_t target,
                                              uint32_t spins)
{
    for (uint32_t spin = 0; spin < spins; spin++)
        if (epx_ld_acquire_sys(flag) >= target)
            return 1;
    return 0;
}

/*
 * The last-block barrier. Called by every thread of every block at the end of its work:
 * returns nonzero in exactly one block, the last to arrive, once every block's writes
 * (peer memory included) are visible at system scope. Resets the counter for the next
 * launch. Fences (release-acquire at system scope): each thread's own before the block
 * barrier, then thread 0's (cumulative over the block) before it counts; the normal-mode
 * kernels used the first, the low-latency kernels the second, and this keeps both.
 * `flag` is a __shared__ int of the calling kernel (a function-scope __shared__ here
 * would make the host compiler emit C++ static-guard calls into a C program).
 *
 * kSystem false (epx_last_block_reader): thread 0's fences at GPU scope and no per-thread
 * fence, for a kernel whose blocks publish nothing to other ranks through this barrier:
 * the one-node combine (it loads peers' rows and writes only this rank's output), and
 * low-latency kernels 2's dispatch send and combine receive (each block publishes its
 * own rows with a system-scope release of its own, nvshmem/ll2_device.cuh; what the last
 * block then publishes it publishes with system-scope releases or a system fence, which
 * are cumulative over what it has observed). For the one-node combine, what the finish
 * exchange's release store (system scope) must order before it is every block's loads
 * from peers, whose values the block has summed and stored before it arrives; the block
 * barrier and thread 0's GPU-scope release on the counter, acquired by the last block,
 * carry them to the thread that stores the flag, and a release is cumulative over what
 * its thread has observed, whatever scope it observed it at. The output rows are read
 * after the kernel, in stream order.
 */
template <bool kSystem>
__device__ __forceinline__ int epx_last_block_scoped(uint32_t *counter, int *flag)
{
    /* Thread 0's fence, at the barrier's scope. */
    auto fence = [] {
        if (kSystem)
            epx_fence_acq_rel_sys();
        else
            epx_fence_acq_rel_gpu();
    };
    if (kSystem)
        epx_fence_acq_rel_sys();
    __syncthreads();
    if (threadIdx.x == 0) {
        fence();
        uint32_t arrived = atomicAdd(counter, 1u);
        *flag = arrived == gridDim.x - 1;
        if (*flag) {
            atomicExch(counter, 0u);
            fence();
        }
    }
    __syncthreads();
    return *flag;
}

__device__ __forceinline__ int epx_last_block(uint32_t *counter, int *flag)
{
    return epx_last_block_scoped<true>(counter, flag);
}

__device__ __forceinline__ int epx_last_block_reader(uint32_t *counter, int *flag)
{
    return epx_last_block_scoped<false>(counter, flag);
}

/*
 * Tokens handed to a kernel's warps as they free up: a token's cost varies with its
 * number of destinations (or sources), so a fixed stride leaves some warps with far more
 * work than others. Each warp takes its first token by index (warp w: token w); later
 * ones by ticket from `counter`, zeroed before the kernel (by the kernel before it on
 * the stream, or a memset): ticket i is token num_warps + i. Lane 0 takes a ticket when
 * the warp starts a token, the warp reads it when it finishes one, so the atomic's
 * latency is hidden behind the token.
 */
__device__ __forceinline__ uint32_t epx_ticket_take(uint32_t *counter, int lane)
{
    return lane == 0 ? atomicAdd(counter, 1u) : 0u;
}

__device__ __forceinline__ int64_t epx_ticket_token(uint32_t ticket, int64_t num_warps)
{
    return num_warps + (int64_t)__shfl_sync(0xffffffffu, ticket, 0);
}

/*
 * The tool calls' routing (epx_fanout_copy, epx_fanin_reduce; include/epx_tool.h): row
 * `row` goes to (or is summed from) k = floor((row + 1) * F / 1000) - floor(row * F /
 * 1000) ranks for an average F in thousandths, as the host's epx__fanout_count
 * (src/ops/backend.h) computes it from the same F.
 */
__device__ __forceinline__ int epx_fanout_count(int64_t row, int64_t milli)
{
    return static_cast<int>((row + 1) * milli / 1000 - row * milli / 1000);
}

/* ---------------------------------------------------------------- bf16 */

__device__ __forceinline__ float epx_bf16_lo(uint32_t pair)
{
    return __uint_as_float(pair << 16);
}

__device__ __forceinline__ float epx_bf16_hi(uint32_t pair)
{
    return __uint_as_float(pair & 0xffff0000u);
}

/*
 * acc[i] = fma(w, y[i], acc[i]) for the 8 bf16 values y packed in `raw`: one rounding per
 * element (fp32 fused multiply-add, as fmaf on the host), the low-latency combine's sum.
 * The values are unpacked by shifts (a bf16 is the top half of its fp32).
 */
__device__ __forceinline__ void epx_bf16x8_fma(float acc[8], float w, const int4 &raw)
{
    const uint32_t pairs[4] = {(uint32_t)raw.x, (uint32_t)raw.y, (uint32_t)raw.z, (uint32_t)raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc[2 * i] = __fmaf_rn(w, epx_bf16_lo(pairs[i]), acc[2 * i]);
        acc[2 * i + 1] = __fmaf_rn(w, epx_bf16_hi(pairs[i]), acc[2 * i + 1]);
    }
}

/* Round to nearest even, NaN kept quiet: the same rule as the host oracle. */
__device__ __forceinline__ uint32_t epx_float_to_bf16(float value)
{
    uint32_t word = __float_as_uint(value);
    if ((word & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    word += 0x7fffu + ((word >> 16) & 1u);
    return word >> 16;
}

__device__ __forceinline__ uint32_t epx_pack_bf16(float lo, float hi)
{
    return epx_float_to_bf16(lo) | (epx_float_to_bf16(hi) << 16);
}

/* ---------------------------------------------------------------- kernel boundaries */

/*
 * Programmatic dependent launch. A kernel launched with epx_launch_early may start while
 * the kernel before it on the stream still runs, once every block of that one has called
 * epx_let_next_start (or ended); before it reads anything the earlier kernel wrote, it
 * calls epx_wait_previous, which returns once that kernel has ended and its writes are
 * visible. A block's first epx_let_next_start counts for the whole block. What it saves
 * is the launch at the boundary (docs/PERFORMANCE.md "Kernel boundaries": where each
 * kernel lets the next start, and why). Without the attribute the wait returns at once.
 */
__device__ __forceinline__ void epx_let_next_start(void)
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void epx_wait_previous(void)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

template <typename... Params, typename... Args>
static cudaError_t epx_launch_early(void (*kernel)(Params...), dim3 grid, dim3 block,
                                    size_t smem, cudaStream_t stream, Args... args)
{
    cudaLaunchAttribute early;
    early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &early;
    /* A build may set -DEPX_NO_EARLY to launch plainly (A/B of the boundaries). */
#ifdef EPX_NO_EARLY
    config.numAttrs = 0;
#else
    config.numAttrs = 1;
#endif
    return cudaLaunchKernelEx(&config, kernel, args...);
}

/* ---------------------------------------------------------------- warps */

__device__ __forceinline__ int epx_lane(void)
{
    return (int)(threadIdx.x & 31);
}

__device__ __forceinline__ int epx_warp(void)
{
    return (int)(threadIdx.x >> 5);
}

#endif /* EPX_OPS_CUDA_DEVICE_CUH */
