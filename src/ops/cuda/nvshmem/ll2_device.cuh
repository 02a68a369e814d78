/*
 * What the kernels-2 low-latency kernels (ll2_dispatch.cu, ll2_combine.cu) add to
 * ll_device.cuh: tagged words (the count exchange), cumulative arrival counters raised
 * with system-scope release reductions, a last-block handshake without system fences,
 * how slots are given back (EPX_LL_RELEASE), a warp scan, and asynchronous copies into
 * shared memory.
 *
 * Memory ordering, in one place (each use points here):
 * - A tagged word is (tag << 32) | value, written with one 64-bit store to a direct peer
 *   (single-copy atomic). It carries its own validity: a reader that sees the tag of
 *   this operation sees the value written with it, and no other data is published
 *   through it, so relaxed stores and loads suffice. To peers reached by puts the words
 *   go in one put with a signal, and readers wait for the signal first (a put need not
 *   write each 8-byte word whole; NVSHMEM delivers the signal after the data).
 * - Rows are published by counters: a block stores its rows (plain weak stores by many
 *   threads), __syncthreads(), then one thread adds the block's count to the receiver's
 *   counter with red.release.sys. PTX release is cumulative: every store that precedes
 *   the barrier is ordered before the addition for any thread that observes it with an
 *   acquire load (ld.acquire.sys in epx_ll_wait), so a receiver that sees the counter
 *   reach its target sees every row counted in it. NVSHMEM puts add to the same
 *   counters with put-with-signal, which NVSHMEM delivers after the put's data.
 * - The counters are cumulative (never cleared): the receiver keeps, in its own device
 *   memory, how far it has counted (shape.arrived / combine_arrived), and the sender
 *   says in the count exchange how many units this operation adds.
 *
 * Launched early: both kernels go out with epx_launch_early (device.cuh), wait for the
 * kernel before them on the stream before anything else, and let the next one be placed
 * only at their end, after every wait of theirs. A block waiting to start holds an SM, so
 * it must never do so while this rank still waits for a peer whose blocks are not placed
 * yet: after the last wait, this rank needs nothing more from any peer.
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_LL2_DEVICE_CUH
#define EPX_OPS_CUDA_NVSHMEM_LL2_DEVICE_CUH

#include "ops/cuda/nvshmem/ll_device.cuh"

#if EPX_LL2_THREADS != EPX_LL_THREADS
#error "kernels 2 assume the blocks of kernels 1 (EPX_LL2_THREADS in ll_plugin.h)"
#endif

/* ---------------------------------------------------------------- tagged words */

__device__ __forceinline__ uint64_t epx_ll2_tagged(uint32_t tag, uint32_t value)
{
    return ((uint64_t)tag << 32) | value;
}

__device__ __forceinline__ void epx_ll2_st_relaxed_sys(uint64_t *p, uint64_t v)
{
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t epx_ll2_ld_relaxed_sys(const uint64_t *p)
{
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

/*
 * Wait until the tagged word at `word` carries `tag`: its value, or -1 when the peer is
 * (or becomes) masked or stays silent past the timeout (then it is masked here and the
 * failure record written once, as epx_ll_wait does). Tags compare for equality, so they
 * may wrap: a stale word is always from an earlier operation of the same slot.
 */
static __device__ __noinline__ int64_t epx_ll2_wait_tag_slow(const uint64_t *word, uint32_t tag,
                                                             int32_t *mask, int world, int peer,
                                                             epx_ll_fail_t *fail,
                                                             int64_t timeout_ns, int stage)
{
    volatile int32_t *masked = mask + peer;
    uint64_t start = epx_globaltimer();
    for (;;) {
        for (int spin = 0; spin < 64; spin++) {
            uint64_t v = epx_ll2_ld_relaxed_sys(word);
            if ((uint32_t)(v >> 32) == tag)
                return (int64_t)(uint32_t)v;
        }
        if (*masked)
            return -1;
        if (epx_globaltimer() - start > (uint64_t)timeout_ns) {
            epx_ll_give_up(mask, world, peer, fail, stage);
            return -1;
        }
    }
}

/* The value already loaded (`v`) when it carries the tag, else the slow wait. */
__device__ __forceinline__ int64_t epx_ll2_tag_value(const epx_ll_shape_t &s, const uint64_t *word,
                                                     uint64_t v, uint32_t tag, int peer, int stage)
{
    if ((uint32_t)(v >> 32) == tag)
        return (int64_t)(uint32_t)v;
    if (*reinterpret_cast<volatile int32_t *>(s.mask + peer))
        return -1;
    return epx_ll2_wait_tag_slow(word, tag, s.mask, s.world, peer, s.fail, s.timeout_ns, stage);
}

/* ---------------------------------------------------------------- phase trace */

/*
 * Thread 0 of this block records the global timer for event `ev` of operation (seq, slot)
 * of `kind` (ll_plugin.h, EPX_LL_TRACE_*); nothing when the trace is off. Block 0 also
 * records which operation the times belong to.
 */
__device__ __forceinline__ void epx_ll2_trace(const epx_ll_shape_t &s, int kind, int slot,
                                              uint64_t seq, int ev)
{
    if (s.trace == NULL || threadIdx.x != 0)
        return;
    const uint64_t id = seq * 2 + (uint64_t)slot;
    const size_t call = (size_t)(id % EPX_LL_TRACE_CALLS) * 2 + (size_t)kind;
    s.trace[(call * (size_t)s.blocks + blockIdx.x) * EPX_LL_TRACE_EVENTS + ev] = epx_globaltimer();
    if (blockIdx.x == 0)
        s.trace[(size_t)EPX_LL_TRACE_CALLS * 2 * (size_t)s.blocks * EPX_LL_TRACE_EVENTS + call] = id + 1;
}

/* ---------------------------------------------------------------- counters */

/* Add `v` to a counter at system scope, after everything this thread has observed. */
__device__ __forceinline__ void epx_ll2_red_release_sys(uint64_t *p, uint64_t v)
{
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Wait until a counter reaches `target` (1), or the peer is masked or silent (0). */
__device__ __forceinline__ int epx_ll2_wait_count(const epx_ll_shape_t &s, const uint64_t *counter,
                                                  uint64_t target, int peer, int stage)
{
    return epx_ll_wait(counter, target, s.mask, s.world, peer, s.fail, s.timeout_ns, stage);
}

/* ---------------------------------------------------------------- slot releases */

/*
 * How a slot is given back (EPX_LL_RELEASE, shape.release; every rank the same):
 *
 * 1: "done" flags (the default until 2026-12-06, kept for A/B runs). The receive's last
 * block of each combine tells every expert rank that its combine input is free
 * (COMBINE_DONE) and gives the step's dispatch results back (DISPATCH_DONE), behind one
 * system-scope fence; the next combine of the slot waits for COMBINE_DONE, the next
 * dispatch into it for DISPATCH_DONE.
 *
 * 2 (the default): inferred. No flags at the end of a combine, one system-scope release
 * round a step fewer (5-15 us a step on an H100 with 8 processes, docs/PERFORMANCE.md).
 * What those flags said is read from messages every rank sends anyway:
 * - The combine input (and, for peers reached by puts, the home's combine staging) of a
 *   slot is free again once every home rank has ended its combines of the slot's step n.
 *   A home's reads end with its combine kernel; its dispatch n + 2 (the same slot) comes
 *   later in its stream and publishes its counts to every rank. An expert rank writes the
 *   slot's combine input again only after its own dispatch n + 2 has read every
 *   unmasked source's counts: its caller fills the zero-copy buffer from that dispatch's
 *   results, and a combine is refused before its dispatch is received. So the first
 *   combine after a dispatch waits for nothing. A second combine of the same dispatch has
 *   no dispatch in between: it first tells every peer that its previous combine is done
 *   (COMBINE_DONE; its kernel ended before this one started), then waits for theirs.
 * - A receiver is done with a slot's dispatch results when it combines that step (the
 *   caller's contract). Its combine raises an "outputs ready" flag at every direct peer
 *   (the homes wait for it before they read), after its last read of those results. A
 *   sender's own combine of that step has waited for the flag (as a home), so its next
 *   dispatch into the slot waits for nothing from direct peers. Peers reached by puts
 *   get no such flag; the combine still gives the results back to them with
 *   DISPATCH_DONE signals. A step without a combine is given back by the next dispatch
 *   into its slot, to every peer, as in kernels 1.
 * The device state `combined` keeps, per slot, the dispatch whose step was combined last,
 * so that a dispatch knows whether to wait for DISPATCH_DONE and a combine whether it is a
 * second one. tests/model/ll_slot_release.py explores every interleaving of both forms.
 */

__device__ __forceinline__ int epx_ll2_inferred(const epx_ll_shape_t &s)
{
    return s.release == 2;
}

/*
 * Must combine `seq` of `slot` wait until the homes ended the slot's previous combine
 * (COMBINE_DONE at seq - 1)? With done flags every combine but the first does; inferred,
 * only a second (or later) combine of the slot's dispatch.
 */
__device__ __forceinline__ int epx_ll2_combine_waits(const epx_ll_shape_t &s, int slot, uint64_t seq)
{
    if (!epx_ll2_inferred(s))
        return seq > 1;
    return epx_ld_volatile_u64(s.combined + slot) == epx_ll_seq(s, slot, 0);
}

/*
 * Inferred releases, a second combine's handshake, the first half: tell every unmasked
 * peer that this rank's combine `done` of the slot has ended (with done flags the previous
 * combine told them at its end). Threads `first`, + `stride`, ... share the peers.
 */
__device__ __forceinline__ void epx_ll2_tell_combined(const epx_ll_shape_t &s, int slot,
                                                      uint64_t done, int first, int stride)
{
    if (!epx_ll2_inferred(s))
        return;
    for (int r = first; r < s.world; r += stride)
        if (!*reinterpret_cast<volatile int32_t *>(s.mask + r))
            epx_ll_signal(s, r, EPX_LL_KIND_COMBINE_DONE, slot, done);
}

/*
 * This rank combines the step of dispatch `value` of `slot`: it is done with those
 * results. With done flags every unmasked peer gets DISPATCH_DONE; inferred, only peers
 * reached by puts do (direct peers learn it from the outputs-ready flags). Records
 * `released` (so the next dispatch into the slot does not give it back again) and
 * `combined`, only after every block of the combine has read `combined`
 * (epx_ll2_combine_waits). Every thread of one block calls it.
 */
__device__ __forceinline__ void epx_ll2_give_back(const epx_ll_shape_t &s, int slot, uint64_t value)
{
    if (value == 0 || epx_ld_volatile_u64(s.released + slot) >= value)
        return;
    const int direct_too = !epx_ll2_inferred(s);
    for (int r = threadIdx.x; r < s.world; r += blockDim.x)
        if ((direct_too || s.peer[r] == NULL) && !*reinterpret_cast<volatile int32_t *>(s.mask + r))
            epx_ll_signal(s, r, EPX_LL_KIND_DISPATCH_DONE, slot, value);
    __syncthreads();
    if (threadIdx.x == 0) {
        s.released[slot] = value;
        s.combined[slot] = value;
    }
}

/*
 * ok[r] for the send of dispatch `seq` of `slot`: receiver r unmasked and done with the
 * slot's previous results: its DISPATCH_DONE flag, except (inferred) when that dispatch
 * was combined and r is a direct peer: then r's outputs-ready flag of the slot's last
 * combine says so, and this rank's own receive of that combine waited for it (an
 * acquire) before the kernels that follow it in its stream, this one among them: nothing
 * to wait for. Every thread of the block calls it.
 */
__device__ __forceinline__ void epx_ll2_wait_released(const epx_ll_shape_t &s, int slot,
                                                      uint64_t seq, int32_t *ok)
{
    const uint64_t previous = seq - 1;
    const int combined =
        epx_ll2_inferred(s) && epx_ld_volatile_u64(s.combined + slot) == previous;
    for (int r = threadIdx.x; r < s.world; r += blockDim.x) {
        int alive = !*reinterpret_cast<volatile int32_t *>(s.mask + r);
        if (alive && previous > 0 && !(combined && s.peer[r] != NULL))
            alive = epx_ll_wait(epx_ll_own_flag(s, EPX_LL_KIND_DISPATCH_DONE, slot, r), previous,
                                s.mask, s.world, r, s.fail, s.timeout_ns,
                                EPX_LL_STAGE_DISPATCH_RELEASE);
        ok[r] = alive;
    }
    __syncthreads();
}

/* ---------------------------------------------------------------- scans */

/*
 * Exclusive prefix sum of a[0..n) in place, by one warp (every lane calls it with the
 * same arguments); returns the total to every lane. Each lane sums a contiguous run.
 */
__device__ __forceinline__ int32_t epx_ll2_warp_scan(int32_t *a, int n, int lane)
{
    const int per = (n + 31) / 32;
    const int begin = min(n, lane * per), end = min(n, begin + per);
    int32_t sum = 0;
    for (int i = begin; i < end; i++)
        sum += a[i];
    int32_t inclusive = sum;
    for (int d = 1; d < 32; d <<= 1) {
        int32_t other = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d)
            inclusive += other;
    }
    int32_t run = inclusive - sum;
    for (int i = begin; i < end; i++) {
        int32_t v = a[i];
        a[i] = run;
        run += v;
    }
    __syncwarp();
    return __shfl_sync(0xffffffffu, inclusive, 31);
}

/* ---------------------------------------------------------------- asynchronous copies */

/* 16 bytes global -> shared without registers (cp.async, L2 only: rows written by peers
 * must never come from a stale L1 line). */
__device__ __forceinline__ void epx_ll2_cp_async16(void *smem, const void *gmem)
{
    unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}

__device__ __forceinline__ void epx_ll2_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Wait until at most `kPending` of this thread's newest copy groups are in flight. */
template <int kPending>
__device__ __forceinline__ void epx_ll2_cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

/* Runtime-depth wait (the stages are a launch argument): 0..3 groups left in flight. */
__device__ __forceinline__ void epx_ll2_cp_async_wait_pending(int pending)
{
    if (pending >= 3)
        epx_ll2_cp_async_wait<3>();
    else if (pending == 2)
        epx_ll2_cp_async_wait<2>();
    else if (pending == 1)
        epx_ll2_cp_async_wait<1>();
    else
        epx_ll2_cp_async_wait<0>();
}

/* Ask L2 to fetch the line holding `p` (a hint; nothing waits for it). */
__device__ __forceinline__ void epx_ll2_prefetch_l2(const void *p)
{
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

#endif /* EPX_OPS_CUDA_NVSHMEM_LL2_DEVICE_CUH */
