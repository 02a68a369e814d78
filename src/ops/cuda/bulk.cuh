/*
 * Bulk copies through shared memory (sm_90 TMA, `cp.async.bulk`): the helpers of the
 * bulk-copy kernels (EPX_NORMAL_KERNELS=2: dispatch_bulk.cu, combine_bulk.cu), the staged
 * dispatch (EPX_NORMAL_KERNELS=3: dispatch_staged.cu) and the fan-out microbenchmark in
 * copy_fanout.cu. Every kernel file uses these instead of writing its own inline PTX.
 *
 * The pattern: a ring of stages in shared memory, one mbarrier per stage. One thread
 * arms a stage's barrier with the bytes it expects and starts bulk loads (global ->
 * shared) that complete on it; whoever needs the data waits on the barrier's phase
 * parity; bulk stores (shared -> global, peer memory mapped by CUDA IPC included) are
 * committed as one group per item, and a stage is refilled only after the groups that
 * read it have finished reading (`wait_group.read`). One thread keeps a whole ring of
 * rows in flight, which is what a copy needs: bytes in flight, not instructions.
 *
 * Proxies: bulk copies run in the async proxy. Shared memory the generic proxy read is
 * fenced before a bulk load overwrites it; bulk stores are waited for (`wait_group 0`)
 * and fenced before the generic release that tells peers the data landed.
 */
#ifndef EPX_OPS_CUDA_BULK_CUH
#define EPX_OPS_CUDA_BULK_CUH

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "device.cuh"
#include "launch.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "the bulk-copy kernels need sm_90 (CMAKE_CUDA_ARCHITECTURES 90)"
#endif

/* Largest number of stages one ring may have (barriers live in static shared memory). */
#define EPX_BULK_MAX_STAGES 8
/* Warps per block of the bulk kernels, each with its own ring (one block per SM). */
#define EPX_BULK_PIPES 4
/* Shared memory the rings of one block take at most, by default (the device allows
 * 227 KiB per block on sm_90; a little is left to the kernels' static arrays). */
#define EPX_BULK_RING_BYTES (192 * 1024)

__device__ __forceinline__ uint32_t epx_smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* ---------------------------------------------------------------- mbarriers */

__device__ __forceinline__ void epx_mbar_init(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(epx_smem_addr(bar)), "r"(count)
                 : "memory");
}

/* After the inits, before any bulk copy completes on those barriers. */
__device__ __forceinline__ void epx_mbar_init_fence(void)
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Arrive (the barrier's one expected arrival) and expect `bytes` of bulk loads. */
__device__ __forceinline__ void epx_mbar_arrive_expect(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     epx_smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

/* One plain arrival (release: this thread's earlier reads of the stage are done). */
__device__ __forceinline__ void epx_mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(epx_smem_addr(bar)) : "memory");
}

/* 1 once the phase of parity `parity` has completed (acquire: its bytes are visible). */
__device__ __forceinline__ int epx_mbar_try_wait(uint64_t *bar, uint32_t parity)
{
    uint32_t done;
    asm volatile("{\n"
                 "  .reg .pred p;\n"
                 "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "  selp.u32 %0, 1, 0, p;\n"
                 "}\n"
                 : "=r"(done)
                 : "r"(epx_smem_addr(bar)), "r"(parity)
                 : "memory");
    return static_cast<int>(done);
}

/*
 * Wait for phase `parity` of `bar`, giving up after `timeout_ns` (0 = returns at once
 * when not complete). Returns 1 when the phase completed, 0 when the wait gave up or
 * `*failed` (this rank's device error flag) became nonzero: the caller records why.
 */
__device__ __forceinline__ int epx_mbar_wait(uint64_t *bar, uint32_t parity, int64_t timeout_ns,
                                             const int32_t *failed)
{
    if (epx_mbar_try_wait(bar, parity))
        return 1;
    const uint64_t start = epx_globaltimer();
    for (;;) {
        for (int spin = 0; spin < 16; spin++)
            if (epx_mbar_try_wait(bar, parity))
                return 1;
        if (*reinterpret_cast<const volatile int32_t *>(failed) != 0 ||
            epx_globaltimer() - start > static_cast<uint64_t>(timeout_ns))
            return 0;
    }
}

/* epx_mbar_wait by a whole warp, its outcome made uniform (every lane 1 only when every
 * lane saw the phase complete), so the warp never splits over a failed wait. */
__device__ __forceinline__ int epx_mbar_wait_warp(uint64_t *bar, uint32_t parity,
                                                  int64_t timeout_ns, const int32_t *failed)
{
    return __all_sync(0xffffffffu, epx_mbar_wait(bar, parity, timeout_ns, failed));
}

/* The next slot of a ring of `stages` slots, its lap counted (a slot's barrier phase is
 * its lap's parity). */
__device__ __forceinline__ void epx_ring_advance(int *slot, uint32_t *lap, int stages)
{
    if (++*slot == stages) {
        *slot = 0;
        ++*lap;
    }
}

/* ---------------------------------------------------------------- bulk copies */

/* global -> shared, `bytes` (a multiple of 16, both addresses 16-byte aligned),
 * completing on `bar` (armed with epx_mbar_arrive_expect for these bytes). */
__device__ __forceinline__ void epx_bulk_load(void *smem_dst, const void *global_src,
                                              uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];" ::"r"(epx_smem_addr(smem_dst)),
                 "l"(global_src), "r"(bytes), "r"(epx_smem_addr(bar))
                 : "memory");
}

/* shared -> global (local or a peer's mapped memory), same size and alignment rules. */
__device__ __forceinline__ void epx_bulk_store(void *global_dst, const void *smem_src,
                                               uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global_dst),
                 "r"(epx_smem_addr(smem_src)), "r"(bytes)
                 : "memory");
}

/* The stores issued since the last commit become one group (possibly empty). */
__device__ __forceinline__ void epx_bulk_commit(void)
{
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* Wait until at most the `kPending` most recent groups still read shared memory. */
template <int kPending>
__device__ __forceinline__ void epx_bulk_wait_read(void)
{
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

/* Wait until every committed store has been performed, then order them before this
 * thread's later generic accesses (the release of a "data landed" flag). */
__device__ __forceinline__ void epx_bulk_wait_all(void)
{
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* Generic-proxy accesses to this CTA's shared memory before, bulk copies after. */
__device__ __forceinline__ void epx_bulk_fence_shared(void)
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* ---------------------------------------------------------------- rings */

/*
 * Whole block, at the start of a ring kernel, once each warp has its part of the ring:
 * lane 0 of each warp initialises the barriers of its `stages` slots. Ends with
 * __syncthreads, which also publishes the shared memory the block wrote before.
 */
__device__ __forceinline__ void epx_bulk_ring_init(uint64_t *bar, int stages)
{
    if (epx_lane() == 0) {
        for (int i = 0; i < stages; i++)
            epx_mbar_init(&bar[i], 1);
        epx_mbar_init_fence();
    }
    __syncthreads();
}

/* a.send_row of token t at ranks `lane` and `lane + 32` (-1 past the last rank); `a` is
 * the kernel's dispatch or combine arguments. */
template <typename Args>
__device__ __forceinline__ void epx_bulk_load_route(const Args &a, int R, int64_t t, int lane,
                                                    int32_t *first, int32_t *second)
{
    *first = lane < R ? a.send_row[t * R + lane] : -1;
    *second = lane + 32 < R ? a.send_row[t * R + lane + 32] : -1;
}

/* ---------------------------------------------------------------- launchers */

/*
 * Shared memory the ring of one block of `kernel` may take: `requested` (0 =
 * EPX_BULK_RING_BYTES), less what the device cannot give beside the kernel's static
 * shared memory.
 */
static inline cudaError_t epx_bulk_ring_budget(const void *kernel, int64_t requested,
                                               int64_t *budget)
{
    int device = 0, optin = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attributes;
    if (err == cudaSuccess)
        err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess)
        return err;
    int64_t room = static_cast<int64_t>(optin) - static_cast<int64_t>(attributes.sharedSizeBytes);
    int64_t wanted = requested > 0 ? requested : EPX_BULK_RING_BYTES;
    *budget = wanted < room ? wanted : room;
    return cudaSuccess;
}

/* Blocks of a bulk kernel for `items` rows or tokens: one per EPX_BULK_PIPES items, at
 * most the SM budget, at least one (the last block signals the peers). */
static inline int epx_bulk_blocks(int64_t items, int num_sms)
{
    int64_t wanted = (items + EPX_BULK_PIPES - 1) / EPX_BULK_PIPES;
    if (wanted > num_sms)
        wanted = num_sms;
    return wanted < 1 ? 1 : static_cast<int>(wanted);
}

static inline int64_t epx_bulk_round_up(int64_t value, int64_t multiple)
{
    return (value + multiple - 1) / multiple * multiple;
}

/*
 * A block's rings sized: `rings` rings (one a warp or a pipe) of as many `stage_bytes`
 * stages as `budget` (epx_bulk_ring_budget) holds, at most `most`, and `kernel` allowed
 * that much dynamic shared memory (*ring_bytes, for its launch). *stages = 0 when fewer
 * than two fit (a slot is refilled only once the next one is taken): the caller then
 * runs its vector kernel.
 */
static inline cudaError_t epx_bulk_ring_fit(const void *kernel, int64_t budget, int rings,
                                            int64_t stage_bytes, int64_t most,
                                            int64_t *stages, int64_t *ring_bytes)
{
    int64_t n = budget / rings / stage_bytes;
    if (n > most)
        n = most;
    *stages = n < 2 ? 0 : n;
    *ring_bytes = rings * *stages * stage_bytes;
    if (*stages == 0)
        return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(*ring_bytes));
}

/*
 * The end of a ring kernel's launcher (dispatch_bulk.cu, combine_bulk.cu): a ring a warp
 * of stages of one slot and its routing (ring.slot_bytes + ring.route_bytes), sized by
 * epx_bulk_ring_fit with at most EPX_BULK_MAX_STAGES; one launch of epx_bulk_blocks
 * blocks over args->num_tokens. When fewer than two stages fit, nothing is launched and
 * *launched stays 0: the caller runs its vector kernel instead.
 */
template <typename Args, typename Ring>
static inline cudaError_t epx_bulk_launch(void (*kernel)(epx__cuda_shape_t, Args, Ring),
                                          const epx__cuda_shape_t *shape, const Args *args,
                                          Ring ring, int64_t budget, cudaStream_t stream,
                                          int *launched)
{
    int64_t stages = 0, ring_bytes = 0;
    cudaError_t err = epx_bulk_ring_fit(reinterpret_cast<const void *>(kernel), budget,
                                        EPX_BULK_PIPES, ring.slot_bytes + ring.route_bytes,
                                        EPX_BULK_MAX_STAGES, &stages, &ring_bytes);
    if (err != cudaSuccess || stages == 0)
        return err;
    ring.stages = static_cast<int>(stages);
    kernel<<<epx_bulk_blocks(args->num_tokens, args->num_sms), EPX_BULK_PIPES * 32,
             static_cast<size_t>(ring_bytes), stream>>>(*shape, *args, ring);
    *launched = 1;
    return cudaGetLastError();
}

#endif /* EPX_OPS_CUDA_BULK_CUH */
