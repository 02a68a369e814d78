/*
 * The store side of a staged ring, one loop for the kernels that have one: the staged
 * dispatch's store warps (dispatch_staged.cu) and the fan-out copy's (copy_fanout.cu,
 * which `epx bench --mode fanout` times as the dispatch's copy alone). Loader warps fill
 * a slot of shared memory with one row (bulk loads completing on the slot's `full`
 * barrier); a group of store threads waits for the slot, each thread stores its share of
 * the row to every destination from registers, and the group gives the slot back.
 */
#ifndef EPX_OPS_CUDA_RING_STORE_CUH
#define EPX_OPS_CUDA_RING_STORE_CUH

#include "bulk.cuh"
#include "signal.cuh"

/*
 * Wait (a whole warp) until a slot's `full` barrier completes phase `lap`; on a timeout
 * or a failure elsewhere returns 0, and lane 0 records the timeout unless a failure is
 * recorded already (`index`: the record's; `tell_peers`: also end the peers' waits, as
 * epx_record_failure does).
 */
__device__ __forceinline__ int epx_ring_wait_full(const epx__cuda_shape_t &s, uint64_t *full,
                                                  uint32_t lap, int index, int tell_peers)
{
    if (epx_mbar_wait_warp(full, lap & 1, s.timeout_ns, &s.local->failed))
        return 1;
    if (epx_lane() == 0 && !epx_failed(s))
        epx_record_failure(s, EPX_CUDA_FAIL_TIMEOUT, EPX_CUDA_STAGE_DISPATCH, s.rank, s.rank, 0,
                           index, tell_peers);
    return 0;
}

/*
 * The first 16-byte unit of thread `thread` (of a group of kThreads) in the `k`th slot a
 * group stores: it turns by a quarter of the group each slot, so the units past a
 * multiple of the group are not always the same warps'.
 */
template <int kThreads>
__device__ __forceinline__ int epx_ring_first_unit(int thread, int k)
{
    static_assert((kThreads & (kThreads - 1)) == 0, "a power of two threads");
    return (thread + (k & 3) * (kThreads / 4)) & (kThreads - 1);
}

/*
 * Thread `first` (epx_ring_first_unit) of a group of kThreads stores its units of the
 * row at `in` (`units` 16-byte units in shared memory) to each of `count` destinations
 * `dst` (shared memory), four units loaded before any is stored. Destinations are read
 * eight at a time, then stored back to back: a shared-memory read between stores waits
 * behind them.
 */
template <int kThreads>
__device__ __forceinline__ void epx_ring_store_row(const char *in, int units,
                                                   char *const *dst, int count, int first)
{
    for (int u0 = first; u0 < units; u0 += 4 * kThreads) {
        int4 v[4];
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (u0 + q * kThreads < units)
                v[q] = reinterpret_cast<const int4 *>(in)[u0 + q * kThreads];
        for (int j0 = 0; j0 < count; j0 += 8) {
            char *d8[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                d8[j] = j0 + j < count ? dst[j0 + j] : nullptr;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (j0 + j >= count)
                    break;
                char *d = d8[j] + static_cast<int64_t>(u0) * 16;
#pragma unroll
                for (int q = 0; q < 4; q++)
                    if (u0 + q * kThreads < units)
                        epx_st_v4(d + q * kThreads * 16, v[q]);
            }
        }
    }
}

#endif /* EPX_OPS_CUDA_RING_STORE_CUH */
