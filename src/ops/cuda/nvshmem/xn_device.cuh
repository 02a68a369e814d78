/*
 * Device helpers of the internode normal mode (xn_dispatch.cu, xn_combine.cu): where a
 * rank sits (node, local rank), symmetric addresses of the control-area slots that
 * NVSHMEM signals name, the row-copy loop shared by every stage, and the tail that
 * ends an operation among the ranks of one node.
 *
 * Addressing: the shared allocation of every rank is NVSHMEM symmetric memory, so an
 * offset names the same place on every rank. Ranks of this node are reached by direct
 * stores through s.local->peers[r] (nvshmem_ptr); ranks on other nodes only through
 * NVSHMEM calls that take this rank's own address of the symmetric object and the
 * target PE (peers[r] is NULL for them, and nothing here ever dereferences it).
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_XN_DEVICE_CUH
#define EPX_OPS_CUDA_NVSHMEM_XN_DEVICE_CUH

#include <nvshmem.h>
#include <nvshmemx.h>

#include "ops/cuda/notify.cuh"

#define EPX_XN_WARPS (EPX_CUDA_THREADS / 32)

__device__ __forceinline__ int epx_xn_node(const epx__cuda_shape_t &s, int rank)
{
    return rank / s.ranks_per_node;
}

/* This rank's own base of the symmetric allocation. */
__device__ __forceinline__ char *epx_xn_own(const epx__cuda_shape_t &s)
{
    return s.local->peers[s.rank];
}

/* The rank of node `node` with this rank's local index: its partner there. */
__device__ __forceinline__ int epx_xn_partner(const epx__cuda_shape_t &s, int node)
{
    return node * s.ranks_per_node + s.rank % s.ranks_per_node;
}

/*
 * Thread 0: where each node's records begin in the forwarded-record order (node order,
 * node n's `node_in[n]` records each), first_record[N] = all of them. The caller syncs.
 */
__device__ __forceinline__ void epx_xn_first_records(const int32_t *node_in, int num_nodes,
                                                     int32_t *first_record)
{
    if (threadIdx.x != 0)
        return;
    int32_t total = 0;
    for (int node = 0; node < num_nodes; node++) {
        first_record[node] = total;
        total += node_in[node];
    }
    first_record[num_nodes] = total;
}

/*
 * The symmetric address (this rank's own copy) of the field at `offset` in the slot that
 * rank `writer` owns in every control area: passed to NVSHMEM with the target PE, it
 * names that field in the target's control area.
 */
__device__ __forceinline__ uint64_t *epx_xn_slot_field(const epx__cuda_shape_t &s, int writer,
                                                       size_t offset)
{
    char *slot = epx_xn_own(s) + s.off_slots + (int64_t)writer * sizeof(epx__cuda_slot_t);
    return reinterpret_cast<uint64_t *>(slot + offset);
}

/*
 * Test mode (EPX_XN_TEST_DELAY_NS): hold a pseudo-random half of the puts for up to
 * `delay_ns`, so records and partial sums arrive late and out of order on purpose and a
 * missing wait or a wrong count fails a test on one machine rather than on a cluster.
 * epx_xn_test_delay: lane 0 sleeps, the warp waits for it at the put; epx_xn_test_sleep:
 * the calling thread sleeps (a lane that sends credits on its own).
 */
__device__ __forceinline__ void epx_xn_test_sleep(int64_t delay_ns, uint64_t key)
{
    if (delay_ns <= 0)
        return;
    uint64_t h = (key + 0x9e3779b97f4a7c15ull) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
    if (h & 1u)
        __nanosleep((unsigned)((h >> 1) % (uint64_t)delay_ns));
}

__device__ __forceinline__ void epx_xn_test_delay(int64_t delay_ns, uint64_t key)
{
    if (epx_lane() == 0)
        epx_xn_test_sleep(delay_ns, key);
}

/*
 * Copy one row of `units` 16-byte vectors from `src` to `n` destinations, the warp's lanes
 * splitting the row. `fresh` sources (written by a peer during this kernel) are read
 * through L2 only; others with the read-only path. Each source byte is read once.
 */
template <int kUnroll>
__device__ __forceinline__ void epx_xn_copy_row(const char *src, int src_align, int fresh_src,
                                                char *const *dst, int n, int64_t units)
{
    const int lane = epx_lane();
    for (int64_t i0 = 0; i0 < units; i0 += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            int64_t i = i0 + u * 32 + lane;
            if (i < units)
                v[u] = fresh_src ? __ldcg(reinterpret_cast<const int4 *>(src) + i)
                                 : epx_ld16(src + i * 16, src_align);
        }
        for (int j = 0; j < n; j++)
            epx_st16_batch<kUnroll>(dst[j], v, i0, units, lane);
    }
}

/*
 * The tail of an operation's last kernel, run by its last block: raise this rank's flag
 * at `flag_offset` for `seq` at every rank of its node (release), wait for theirs, then
 * mark the operation finished here. Ranks of other nodes took part through NVSHMEM
 * counters that the kernels already waited for.
 */
__device__ __forceinline__ void epx_xn_finish_node(const epx__cuda_shape_t &s, size_t flag_offset,
                                                   uint64_t seq, int stage)
{
    const int P = s.ranks_per_node, first = epx_xn_node(s, s.rank) * P, me = s.rank;
    for (int p = threadIdx.x; p < P; p += blockDim.x)
        epx_st_release_sys(epx_slot_flag(epx_slot(s, first + p, me), flag_offset), seq);
    for (int p = threadIdx.x; p < P; p += blockDim.x)
        epx_wait_flag(s, epx_slot_flag(epx_slot(s, me, first + p), flag_offset), seq, stage,
                      first + p);
    __syncthreads();
    if (threadIdx.x == 0)
        *reinterpret_cast<volatile uint64_t *>(&s.local->epoch) = seq;
}

#endif /* EPX_OPS_CUDA_NVSHMEM_XN_DEVICE_CUH */
