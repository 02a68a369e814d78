/*
 * What the low-latency kernels share: addresses in the symmetric heap, stores to a
 * peer (a direct store when NVSHMEM gives a pointer, else an NVSHMEM put), signals,
 * the timed wait that masks a silent peer, and the last-block handshake.
 *
 * Flags are sequence numbers: the sender of operation n of a slot raises the flag to
 * n, the waiter waits for >= n, nothing is ever cleared. The sequence numbers live on
 * the device (shape.seq) and the send kernels advance them, so a step captured in a
 * CUDA graph keeps counting when it is replayed.
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_LL_DEVICE_CUH
#define EPX_OPS_CUDA_NVSHMEM_LL_DEVICE_CUH

#include <nvshmem.h>
#include <nvshmemx.h>

#include "core/constants.h"
#include "ops/cuda/device.cuh"
#include "ops/cuda/ll_plugin.h"

/* Threads per block (one block per SM of the budget). 512 leaves each thread the ~100
 * registers the kernels use; at 1024 they get 64 and spill to local memory, which
 * measured 10% slower on a whole step (docs/PERFORMANCE.md, 2026-12-03). Overridable
 * (-DEPX_LL_THREADS=...) for such comparisons. */
#ifndef EPX_LL_THREADS
#define EPX_LL_THREADS 512
#endif
#define EPX_LL_WARPS (EPX_LL_THREADS / 32)
/* The phase argument of the epx::ll::dispatch and epx::ll::combine kernels. */
#define EPX_LL_PHASE_SEND 0
#define EPX_LL_PHASE_RECV 1

/* Index of the arrival counters (shape.arrive[slot * 4 + which]). */
enum { EPX_LL_ARRIVE_DISPATCH_SEND = 0, EPX_LL_ARRIVE_DISPATCH_RECV = 1,
       EPX_LL_ARRIVE_COMBINE_SEND = 2, EPX_LL_ARRIVE_COMBINE_RECV = 3 };

/* Offset of flag (kind, slot, peer) from a rank's symmetric base. */
__device__ __forceinline__ size_t epx_ll_flag_offset(const epx_ll_shape_t &s, int kind, int slot,
                                                     int peer)
{
    return s.flags + ((size_t)(kind * 2 + slot) * (size_t)s.world + (size_t)peer) * sizeof(uint64_t);
}

__device__ __forceinline__ const uint64_t *epx_ll_own_flag(const epx_ll_shape_t &s, int kind,
                                                           int slot, int peer)
{
    return reinterpret_cast<const uint64_t *>(s.sym + epx_ll_flag_offset(s, kind, slot, peer));
}

/* Raise this rank's flag (kind, slot) at rank r to `value`, after this thread's stores. */
__device__ __forceinline__ void epx_ll_signal(const epx_ll_shape_t &s, int r, int kind, int slot,
                                              uint64_t value)
{
    size_t offset = epx_ll_flag_offset(s, kind, slot, s.rank);
    char *base = s.peer[r];
    if (base != NULL) {
        epx_st_release_sys(reinterpret_cast<uint64_t *>(base + offset), value);
    } else {
        nvshmem_fence();
        nvshmemx_signal_op(reinterpret_cast<uint64_t *>(s.sym + offset), value,
                           NVSHMEM_SIGNAL_SET, r);
    }
}

/* One int32 into rank r's symmetric memory at `offset`. */
__device__ __forceinline__ void epx_ll_put_int(const epx_ll_shape_t &s, int r, size_t offset,
                                               int32_t value)
{
    char *base = s.peer[r];
    if (base != NULL)
        *reinterpret_cast<int32_t *>(base + offset) = value;
    else
        nvshmem_int_p(reinterpret_cast<int *>(s.sym + offset), value, r);
}

/*
 * A wait gave up on `peer`: mask it, and write the failure record (stage, peer) unless an
 * earlier failure did; mask[world] claims the record, so the first failure is the one
 * reported.
 */
__device__ __forceinline__ void epx_ll_give_up(int32_t *mask, int world, int peer,
                                               epx_ll_fail_t *fail, int stage)
{
    atomicExch(mask + peer, 1);
    if (atomicCAS(mask + world, 0, 1) == 0) {
        volatile epx_ll_fail_t *f = fail;
        f->stage = stage;
        f->peer = peer;
        __threadfence_system();
        f->code = 1;
        __threadfence_system();
    }
}

/*
 * topk_idx[index] = value, given to the operation of `stage` (EPX_LL_STAGE_DISPATCH or
 * _COMBINE), is neither -1 nor an expert id: write the failure record's bad-id part unless
 * an earlier bad id did (no peer is masked). The callers then treat the entry as -1, so
 * every count, row and sum stays consistent (and in bounds).
 */
static __device__ __noinline__ void epx_ll_bad_expert(const epx_ll_shape_t &s, int stage,
                                                      int64_t index, int64_t value)
{
    if (atomicCAS(s.mask + s.world + 1, 0, 1) == 0) {
        volatile epx_ll_fail_t *f = s.fail;
        f->bad_stage = stage;
        f->bad_index = index;
        f->bad_value = value;
        __threadfence_system();
        f->bad_id = 1;
        __threadfence_system();
    }
}

/* Entry `index`'s id as the kernels use it: -1 (none) for -1 and for anything out of range,
 * which is recorded when `record` (the caller reads each entry once: no second record). */
__device__ __forceinline__ int epx_ll_expert_or_none(const epx_ll_shape_t &s, int stage,
                                                     int64_t index, int64_t e, int record = 1)
{
    if (e >= 0 && e < s.num_experts)
        return (int)e;
    if (e != -1 && record)
        epx_ll_bad_expert(s, stage, index, e);
    return -1;
}

/*
 * Wait until *flag >= target. Returns 1 when it got there, 0 when the peer is (or
 * becomes) masked: by another block, by the host, or here after the timeout, which
 * also writes the failure record once (the host reports it, naming the rank).
 */
static __device__ __noinline__ int epx_ll_wait(const uint64_t *flag, uint64_t target,
                                               int32_t *mask, int world, int peer,
                                               epx_ll_fail_t *fail, int64_t timeout_ns,
                                               int stage)
{
    if (epx_ld_acquire_sys(flag) >= target)
        return 1;
    volatile int32_t *masked = mask + peer;
    if (*masked)
        return 0;
    uint64_t start = epx_globaltimer();
    for (;;) {
        if (epx_spin_until(flag, target, 64))
            return 1;
        if (*masked)
            return 0;
        if (epx_globaltimer() - start > (uint64_t)timeout_ns) {
            epx_ll_give_up(mask, world, peer, fail, stage);
            return 0;
        }
    }
}

/*
 * ok[r] = 1 for each unmasked peer whose flag (kind, slot) reached `target` (0 = no
 * wait), 0 for masked or silent peers. Every thread of the block calls it.
 */
__device__ __forceinline__ void epx_ll_wait_peers(const epx_ll_shape_t &s, int kind, int slot,
                                                  uint64_t target, int stage, int32_t *ok)
{
    for (int r = threadIdx.x; r < s.world; r += blockDim.x) {
        int alive = !*reinterpret_cast<volatile int32_t *>(s.mask + r);
        if (alive && target > 0)
            alive = epx_ll_wait(epx_ll_own_flag(s, kind, slot, r), target, s.mask, s.world, r,
                                s.fail, s.timeout_ns, stage);
        ok[r] = alive;
    }
    __syncthreads();
}

/*
 * The last-block barrier (epx_last_block in device.cuh), after this block's NVSHMEM puts
 * are completed.
 */
__device__ __forceinline__ int epx_ll_last_block(const epx_ll_shape_t &s, uint32_t *counter,
                                                 int *flag)
{
    if (s.use_puts && (threadIdx.x & 31) == 0)
        nvshmem_quiet();
    return epx_last_block(counter, flag);
}

__device__ __forceinline__ uint64_t epx_ll_seq(const epx_ll_shape_t &s, int slot, int which)
{
    return epx_ld_volatile_u64(s.seq + slot * 2 + which);
}

/*
 * This rank is done with the results of dispatch `value` of `slot` (they lie in the
 * slot's cells, which the sources write): tell every unmasked peer, once. Every thread
 * of one block calls it, or (kWarp) every lane of warp 0 alone.
 */
template <bool kWarp = false>
__device__ __forceinline__ void epx_ll_give_back(const epx_ll_shape_t &s, int slot, uint64_t value)
{
    if (value == 0 || epx_ld_volatile_u64(s.released + slot) >= value)
        return;
    const int stride = kWarp ? 32 : (int)blockDim.x;
    for (int r = threadIdx.x; r < s.world; r += stride)
        if (!*reinterpret_cast<volatile int32_t *>(s.mask + r))
            epx_ll_signal(s, r, EPX_LL_KIND_DISPATCH_DONE, slot, value);
    if (kWarp)
        __syncwarp();
    else
        __syncthreads();
    if (threadIdx.x == 0)
        s.released[slot] = value;
}

/* Does expert e appear in idx[0..j-1]? (a token sends one row per distinct expert) */
__device__ __forceinline__ int epx_ll_seen_before(const int64_t *idx, int j, int64_t e)
{
    for (int i = 0; i < j; i++)
        if (idx[i] == e)
            return 1;
    return 0;
}

/* The i with first[i] <= value < first[i + 1], for ascending first[0..n] (n >= 1). */
__device__ __forceinline__ int epx_ll_find(const int32_t *first, int n, int32_t value)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= value)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Vectors a lane keeps in flight while copying (8 x 16 bytes x 32 lanes = 4 KB a warp). */
#define EPX_LL_COPY_DEPTH 8

/*
 * 16-byte copy of `bytes` (a multiple of 16) by one warp (epx_warp_copy16): each lane
 * loads up to EPX_LL_COPY_DEPTH vectors before it stores them, so a row of a few KB
 * costs one or two memory round trips instead of one per vector.
 */
__device__ __forceinline__ void epx_ll_warp_copy(char *dst, const char *src, size_t bytes, int lane)
{
    epx_warp_copy16<EPX_LL_COPY_DEPTH>(dst, src, (int64_t)(bytes / EPX__VECTOR_BYTES), lane);
}

#endif /* EPX_OPS_CUDA_NVSHMEM_LL_DEVICE_CUH */
