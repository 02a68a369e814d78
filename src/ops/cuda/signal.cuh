/*
 * Signals between ranks, and how a kernel gives up instead of hanging.
 *
 * A signal is a sequence number stored with a release at system scope into the
 * sender's slot of the receiver's control area; the receiver polls with acquire loads.
 * Every poll loop reads %globaltimer against the group's timeout, this rank's device
 * error flag (another block may already have failed) and the abort word peers write
 * when they fail. On expiry the kernel records (code, stage, rank) in the host-mapped
 * error record, tells the peers through their abort words, and returns normally: no
 * trap, so the host can turn the record into EPX_ERR_TIMEOUT naming the rank and stage.
 */
#ifndef EPX_OPS_CUDA_SIGNAL_CUH
#define EPX_OPS_CUDA_SIGNAL_CUH

#include "device.cuh"
#include "launch.h"

__device__ __forceinline__ char *epx_peer(const epx__cuda_shape_t &s, int rank)
{
    return s.local->peers[rank];
}

/* Where `rank`'s combine input starts as mapped here, from what it published in its slot
 * (`slot`, in this rank's control area): its shared allocation or one of its registered
 * ranges (epx_buffer_register), plus the offset. */
__device__ __forceinline__ const char *epx_peer_x(const epx__cuda_shape_t &s, int rank,
                                                  const volatile epx__cuda_slot_t *slot)
{
    const int region = slot->ready_region;
    const char *base = region == 0 ? epx_peer(s, rank) : s.local->registered[region - 1][rank];
    return base + slot->ready_offset;
}

/* `rank`'s slot (the one this rank writes) in `owner`'s control area. */
__device__ __forceinline__ epx__cuda_slot_t *epx_slot(const epx__cuda_shape_t &s, int owner,
                                                     int rank)
{
    return reinterpret_cast<epx__cuda_slot_t *>(epx_peer(s, owner) + s.off_slots) + rank;
}

__device__ __forceinline__ epx__cuda_ctrl_t *epx_ctrl(const epx__cuda_shape_t &s, int owner)
{
    return reinterpret_cast<epx__cuda_ctrl_t *>(epx_peer(s, owner));
}

/* The epoch all blocks of a kernel read at entry (kernels never run concurrently on one
 * buffer: stream order), so one operation uses one sequence number throughout. */
__device__ __forceinline__ uint64_t epx_op_seq(const epx__cuda_shape_t &s)
{
    return epx_ld_volatile_u64(&s.local->epoch) + 1;
}

__device__ __forceinline__ int epx_failed(const epx__cuda_shape_t &s)
{
    return *reinterpret_cast<volatile int32_t *>(&s.local->failed);
}

/* Whole block: this rank's failure flag read once for the block (by thread 0) and
 * shared through a block barrier, so the block's threads leave together or not at all
 * (each reading it could see it change between them, and some leave a barrier short). */
__device__ __forceinline__ int epx_block_failed(const epx__cuda_shape_t &s)
{
    return __syncthreads_or(threadIdx.x == 0 && epx_failed(s));
}

/*
 * Whole block, at the start of a dispatch data kernel: 0 when this rank has failed (the
 * count exchange or an earlier operation; every rank skips the stage, the block leaves),
 * else each rank's memory (NULL where not mapped) and first receive row into peers[] and
 * bases[] (shared memory, filled once the caller's next block barrier has passed).
 */
__device__ __forceinline__ int epx_dispatch_enter(const epx__cuda_shape_t &s, char **peers,
                                                  int32_t *bases)
{
    if (epx_block_failed(s))
        return 0;
    for (int r = threadIdx.x; r < s.world_size; r += blockDim.x) {
        peers[r] = epx_peer(s, r);
        bases[r] = s.local->base[r];
    }
    return 1;
}

/*
 * What the failure paths need, small enough to travel in registers (the noinline
 * helpers below would otherwise force the whole shape onto the stack).
 */
typedef struct {
    epx__cuda_local_t *local;
    epx__cuda_mapped_t *mapped;
    int64_t timeout_ns;
    int rank;
    int world_size;
} epx_fail_ctx_t;

__device__ __forceinline__ epx_fail_ctx_t epx_fail_ctx(const epx__cuda_shape_t &s)
{
    epx_fail_ctx_t c;
    c.local = s.local;
    c.mapped = s.mapped;
    c.timeout_ns = s.timeout_ns;
    c.rank = s.rank;
    c.world_size = s.world_size;
    return c;
}

/*
 * Record the first failure on this rank (later ones are dropped): the host-mapped
 * record, fields first and the code last, so the host never reads a half-written one.
 * `tell_peers` writes the abort word of every peer, so their waits end at once.
 */
static __device__ __noinline__ void epx_record_failure_ctx(epx_fail_ctx_t c, int code, int stage,
                                                    int peer, int reporter, int64_t value,
                                                    int64_t index, int tell_peers)
{
    if (atomicCAS(&c.local->failed, 0, 1) != 0)
        return;
    epx__cuda_mapped_t *m = c.mapped;
    *reinterpret_cast<volatile int32_t *>(&m->error_stage) = stage;
    *reinterpret_cast<volatile int32_t *>(&m->error_peer) = peer;
    *reinterpret_cast<volatile int32_t *>(&m->error_reporter) = reporter;
    *reinterpret_cast<volatile int64_t *>(&m->error_value) = value;
    *reinterpret_cast<volatile int64_t *>(&m->error_index) = index;
    __threadfence_system();
    m->error_code = code;
    if (!tell_peers)
        return;
    /* Timeouts name the silent rank; anything else names this rank as the culprit. */
    int abort_code = code == EPX_CUDA_FAIL_TIMEOUT ? 1 : 2;
    int culprit = code == EPX_CUDA_FAIL_TIMEOUT ? peer : c.rank;
    uint64_t word = EPX_CUDA_ABORT_PACK(abort_code, stage, c.rank, culprit);
    for (int r = 0; r < c.world_size; r++) {
        /* Ranks on other nodes (no mapping) get the word from the host (errors.c). */
        if (r == c.rank || c.local->peers[r] == NULL)
            continue;
        uint64_t *target = &reinterpret_cast<epx__cuda_ctrl_t *>(c.local->peers[r])->abort_word;
        /* First failure wins at the peer too; a relaxed CAS is enough (no data behind it). */
        atomicCAS(reinterpret_cast<unsigned long long *>(target), 0ull,
                  static_cast<unsigned long long>(word));
    }
    __threadfence_system();
}

__device__ __forceinline__ void epx_record_failure(const epx__cuda_shape_t &s, int code,
                                                   int stage, int peer, int reporter,
                                                   int64_t value, int64_t index, int tell_peers)
{
    epx_record_failure_ctx(epx_fail_ctx(s), code, stage, peer, reporter, value, index,
                           tell_peers);
}

__device__ __forceinline__ int epx_failed_ctx(epx_fail_ctx_t c)
{
    return *reinterpret_cast<volatile int32_t *>(&c.local->failed);
}

/*
 * A peer's abort word, if any, becomes this rank's failure (not passed on again), named
 * by where this rank was waiting: that is the call its user sees fail.
 */
__device__ __forceinline__ int epx_check_abort(epx_fail_ctx_t c, int stage)
{
    const uint64_t *own = &reinterpret_cast<epx__cuda_ctrl_t *>(c.local->peers[c.rank])->abort_word;
    uint64_t word = epx_ld_volatile_u64(own);
    if (word == 0)
        return 0;
    epx_record_failure_ctx(c, EPX_CUDA_FAIL_ABORT, stage,
                           EPX_CUDA_ABORT_CULPRIT(word), EPX_CUDA_ABORT_REPORTER(word),
                           EPX_CUDA_ABORT_CODE(word), 0, 0);
    return 1;
}

/*
 * Wait until *flag >= target. Returns 1 on success, 0 when the wait gave up (timeout,
 * peer abort, or another block of this rank already failed); the failure is recorded.
 */
static __device__ __noinline__ int epx_wait_flag_ctx(epx_fail_ctx_t c, const uint64_t *flag,
                                              uint64_t target, int stage, int peer)
{
    if (epx_ld_acquire_sys(flag) >= target)
        return 1;
    uint64_t start = epx_globaltimer();
    for (;;) {
        if (epx_spin_until(flag, target, 32))
            return 1;
        if (epx_failed_ctx(c) || epx_check_abort(c, stage))
            return 0;
        if (epx_globaltimer() - start > static_cast<uint64_t>(c.timeout_ns)) {
            epx_record_failure_ctx(c, EPX_CUDA_FAIL_TIMEOUT, stage, peer, c.rank, 0, 0, 1);
            return 0;
        }
    }
}

__device__ __forceinline__ int epx_wait_flag(const epx__cuda_shape_t &s, const uint64_t *flag,
                                             uint64_t target, int stage, int peer)
{
    return epx_wait_flag_ctx(epx_fail_ctx(s), flag, target, stage, peer);
}

/* The flag at `flag_offset` (offsetof(epx__cuda_slot_t, ...)) of a slot. */
__device__ __forceinline__ uint64_t *epx_slot_flag(epx__cuda_slot_t *slot, size_t flag_offset)
{
    return reinterpret_cast<uint64_t *>(reinterpret_cast<char *>(slot) + flag_offset);
}

/*
 * The tail of a data kernel, run by its last block (epx_last_block): raise this rank's
 * flag for operation `seq` at every peer (release), wait for every peer's (acquire, with
 * the timeout, failures recorded under `stage`), then mark the operation finished here.
 * Every other block has ended, so the next operation's first kernel, when launched early
 * (epx_launch_early: the combine's ready kernel, one block of 64 threads, or a one-block
 * count exchange of 1024 threads, which takes one of the SMs this kernel freed), may be
 * scheduled now and wait for this one's end on its SM instead of being launched after it.
 * The finish exchange makes every rank end at the same moment, and with 8 ranks on one
 * GPU under MPS the launches that follow come 3.5 us apart a rank; launched early, 8
 * back-to-back combines start within 1 us (docs/PERFORMANCE.md, "The staircase of starts
 * is MPS's, whatever the launch").
 */
__device__ __forceinline__ void epx_finish_exchange(const epx__cuda_shape_t &s,
                                                    size_t flag_offset, uint64_t seq, int stage)
{
    epx_let_next_start();
    const int R = s.world_size, me = s.rank;
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        epx_st_release_sys(epx_slot_flag(epx_slot(s, r, me), flag_offset), seq);
    for (int r = threadIdx.x; r < R; r += blockDim.x)
        epx_wait_flag(s, epx_slot_flag(epx_slot(s, me, r), flag_offset), seq, stage, r);
    __syncthreads();
    if (threadIdx.x == 0)
        *reinterpret_cast<volatile uint64_t *>(&s.local->epoch) = seq;
}

#endif /* EPX_OPS_CUDA_SIGNAL_CUH */
