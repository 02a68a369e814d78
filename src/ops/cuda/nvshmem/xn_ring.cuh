/*
 * Rings with credits for the internode normal mode (EPX_XN_RING_TOKENS = C > 0): what
 * xn_ring_dispatch.cu and xn_ring_combine.cu share.
 *
 * A channel is the one-way path from a rank to its partner on another node (the rank
 * with the same local index there): dispatch records go one way, combine partial sums
 * the other. Item j of a channel in an operation (its index among the items the sender
 * has for that node: node_pos) lives in slot j % C of the sender's staging and of the
 * receiver's slots for that sender's node. Each item is one put-with-signal that adds 1
 * to the receiver's arrival counter of the item's chunk (chunks of G items, G divides C;
 * B = C / G counters per ring). Counter c % B serves chunks c, c + B, ... of an
 * operation and is zeroed after the last, so chunk c has landed when it reads
 * (c / B) * G + the chunk's size (epx_xn_chunk_target); a receiver reads an item once
 * its chunk landed.
 *
 * Credits. The receiver counts the items of each chunk it consumed (done, the same way).
 * One warp of the receiver, the credit warp, walks each channel's chunks in order: once
 * a chunk was consumed entirely it adds the chunk's size to the sender's credit counter
 * for that channel (an NVSHMEM signal, ADD, the only way to reach another node). Credits
 * therefore always cover a prefix of the channel: credit = sent + k means items 0..k-1
 * of this operation were consumed, where `sent` is the items put on the channel before
 * this operation. The sender writes item j into slot j % C only when credit >= sent +
 * j + 1 - C (item j - C, the slot's previous tenant, was consumed, so its put also
 * finished reading the staging slot). At the start of an operation the ring is empty
 * (the partner finished the previous one before its count message or its combine entry
 * signal, which every sender waits for), so items 0..C-1 need no credit.
 *
 * Progress (why no deadlock). Warps have one role each: senders only wait for credits
 * (and, in combine, for the home rank's entry signal, which waits for nothing), receivers
 * only for arrivals, the credit warp for neither (it polls). Senders take their work
 * strided (warp k of n: items k, k + n, ...), each in increasing order, and put an item
 * as soon as it is staged. Consider a rank's earliest unfinished item (the smallest among
 * its sender warps' current ones): every earlier item of the rank was put, so on each of
 * its channels every chunk up to the item's chunk minus B can land, be consumed and be
 * credited, which is all the credit the item needs (C >= G). Dispatch forwarders poll
 * all their channels without blocking on one, so a channel's items are consumed as their
 * chunks land. A combine reducer waits for the partial sums of its smallest unconsumed
 * token, whose earlier items on every channel were consumed; a producer it waits for is
 * blocked, if at all, on a home rank of a lower node (producers' items are in node
 * order), so every chain of waits ends at a warp that moves.
 *
 * Warp roles per block: warps [0, EPX_XN_RING_RECEIVERS) receive (forward records, or
 * reduce own tokens), the others send, except the last warp of block 0, which returns
 * credits. At most C items per channel are staged or in flight, so at most C sender
 * warps of a rank work on one channel at a time: the ring bounds the parallelism too.
 * Every wait has the group's timeout and names the rank and stage.
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_XN_RING_CUH
#define EPX_OPS_CUDA_NVSHMEM_XN_RING_CUH

#include "ops/cuda/nvshmem/xn_device.cuh"

/* Receiving warps per block; the rest of EPX_XN_WARPS send (one of block 0's credits). */
#define EPX_XN_RING_RECEIVERS 8

typedef enum { EPX_XN_ROLE_SEND, EPX_XN_ROLE_RECEIVE, EPX_XN_ROLE_CREDIT } epx_xn_role_kind_t;

typedef struct {
    int kind;      /* epx_xn_role_kind_t */
    int64_t index; /* this warp among the warps of its role */
    int64_t count; /* warps of its role in the grid */
} epx_xn_role_t;

__device__ __forceinline__ epx_xn_role_t epx_xn_ring_role(void)
{
    const int warp = epx_warp();
    const int64_t senders = EPX_XN_WARPS - EPX_XN_RING_RECEIVERS;
    epx_xn_role_t r;
    if (warp < EPX_XN_RING_RECEIVERS) {
        r.kind = EPX_XN_ROLE_RECEIVE;
        r.index = (int64_t)blockIdx.x * EPX_XN_RING_RECEIVERS + warp;
        r.count = (int64_t)gridDim.x * EPX_XN_RING_RECEIVERS;
    } else if (blockIdx.x == 0 && warp == EPX_XN_WARPS - 1) {
        r.kind = EPX_XN_ROLE_CREDIT;
        r.index = 0;
        r.count = 1;
    } else {
        r.kind = EPX_XN_ROLE_SEND;
        r.index = (int64_t)blockIdx.x * senders + (warp - EPX_XN_RING_RECEIVERS) -
                  (blockIdx.x > 0 ? 1 : 0);
        r.count = (int64_t)gridDim.x * senders - 1;
    }
    return r;
}

/* One direction's counters (this rank's own copies: symmetric addresses). */
typedef struct {
    uint64_t *arrived; /* [N][B]: items that landed here, per sender node and chunk */
    uint64_t *credit;  /* [N]: credits from the receiver on node n, only grows */
    uint64_t *sent;    /* [N]: items put to node n before this operation */
    uint32_t *done;    /* [N][B]: items consumed here, per sender node and chunk */
} epx_xn_ring_t;

/* combine = 0: dispatch records; 1: combine partial sums. */
__device__ __forceinline__ epx_xn_ring_t epx_xn_ring(const epx__cuda_shape_t &s, int combine)
{
    const epx__cuda_xn_ring_layout_t l =
        epx__cuda_xn_ring_layout(s.num_nodes, s.xn_ring / s.xn_chunk);
    char *base = epx_xn_own(s) + s.off_xn_ring;
    epx_xn_ring_t r;
    r.arrived = reinterpret_cast<uint64_t *>(base + (combine ? l.combine_arrived
                                                             : l.dispatch_arrived));
    r.credit = reinterpret_cast<uint64_t *>(base + (combine ? l.combine_credit
                                                            : l.dispatch_credit));
    r.sent = reinterpret_cast<uint64_t *>(base + (combine ? l.combine_sent : l.dispatch_sent));
    r.done = reinterpret_cast<uint32_t *>(base + (combine ? l.combine_done : l.dispatch_done));
    return r;
}

/* Items in chunk `chunk` of a channel that carries `total` items in this operation. */
__device__ __forceinline__ int64_t epx_xn_chunk_size(const epx__cuda_shape_t &s, int64_t chunk,
                                                     int64_t total)
{
    return min(s.xn_chunk, total - chunk * s.xn_chunk);
}

/*
 * What the arrival (or done) counter of chunk `chunk` reads once the chunk is complete.
 * A counter serves chunks c, c + B, c + 2B, ... of an operation and is zeroed only after
 * the last of them: the earlier ones were full (only an operation's last chunk may be
 * short), and chunk c + B cannot start before chunk c was credited, so the counter
 * cannot mistake an earlier chunk for a later one.
 */
__device__ __forceinline__ uint64_t epx_xn_chunk_target(const epx__cuda_shape_t &s,
                                                        int64_t chunk, int64_t total)
{
    const int64_t chunks = s.xn_ring / s.xn_chunk;
    return (uint64_t)((chunk / chunks) * s.xn_chunk + epx_xn_chunk_size(s, chunk, total));
}

/* The counter index of item j's chunk on the channel from (or to) node `node`. */
__device__ __forceinline__ int64_t epx_xn_chunk_slot(const epx__cuda_shape_t &s, int node,
                                                     int64_t j)
{
    const int64_t chunks = s.xn_ring / s.xn_chunk;
    return (int64_t)node * chunks + (j / s.xn_chunk) % chunks;
}

/* ---------------------------------------------------------------- sending side */

/*
 * How a sending warp stages and puts items: staging `stage` ([N][C] slots of `pitch`
 * bytes, own memory), receiver slots at `dst_offset` in every rank's allocation, and
 * the direction's counters. `enter_offset` >= 0: before a put, wait until the receiver
 * raised that slot flag for this operation (combine: the home rank entered it).
 */
typedef struct {
    char *stage;
    int64_t dst_offset;
    int64_t pitch;
    epx_xn_ring_t ring;
    int credit_stage;
    int64_t enter_offset;
} epx_xn_ring_put_t;

/* Staging slot of item j for node `node`. */
__device__ __forceinline__ char *epx_xn_ring_slot(const epx__cuda_shape_t &s,
                                                  const epx_xn_ring_put_t &p, int node,
                                                  int64_t j)
{
    return p.stage + ((int64_t)node * s.xn_ring + (j & (s.xn_ring - 1))) * p.pitch;
}

/*
 * Before staging item j for node `node`: wait until its slot is free, credit >= sent +
 * j + 1 - C (the slot's previous tenant, item j - C, was consumed). 0 when the wait gave
 * up (the failure is recorded).
 */
__device__ __forceinline__ int epx_xn_ring_reserve(const epx__cuda_shape_t &s,
                                                   const epx_xn_ring_put_t &p, int node,
                                                   int64_t j)
{
    const int64_t C = s.xn_ring;
    if (j < C)
        return 1;
    const uint64_t need = p.ring.sent[node] + (uint64_t)(j + 1 - C);
    int ok = 1;
    if (epx_lane() == 0)
        ok = epx_wait_flag(s, &p.ring.credit[node], need, p.credit_stage,
                           epx_xn_partner(s, node));
    return __shfl_sync(0xffffffffu, ok, 0);
}

/*
 * Put staged item j for node `node` into the receiver's slot with one put-with-signal
 * that adds 1 to the arrival counter of its chunk there (data and arrival in one
 * operation; the caller synced the warp after staging). 0 when a wait gave up.
 */
__device__ __forceinline__ int epx_xn_ring_put(const epx__cuda_shape_t &s,
                                               const epx_xn_ring_put_t &p, int node, int64_t j)
{
    const int me = s.rank, my_node = epx_xn_node(s, me), partner = epx_xn_partner(s, node);
    int ok = 1;
    if (p.enter_offset >= 0 && epx_lane() == 0)
        ok = epx_wait_flag(s, epx_slot_flag(epx_slot(s, me, partner), (size_t)p.enter_offset),
                           epx_op_seq(s), EPX_CUDA_STAGE_COMBINE_ENTER, partner);
    if (!__shfl_sync(0xffffffffu, ok, 0))
        return 0;
    epx_xn_test_delay(s.xn_test_delay_ns, (uint64_t)j * 64 + (uint64_t)node);
    __syncwarp();
    const int64_t slot = j & (s.xn_ring - 1);
    nvshmemx_putmem_signal_nbi_warp(epx_xn_own(s) + p.dst_offset +
                                        ((int64_t)my_node * s.xn_ring + slot) * p.pitch,
                                    epx_xn_ring_slot(s, p, node, j), (size_t)p.pitch,
                                    p.ring.arrived + epx_xn_chunk_slot(s, my_node, j), 1,
                                    NVSHMEM_SIGNAL_ADD, partner);
    return 1;
}

/* ---------------------------------------------------------------- receiving side */

/*
 * Item j from node `node` was consumed (its slot read entirely by this warp): count it
 * for its chunk. Every lane's reads are ordered before the count.
 */
__device__ __forceinline__ void epx_xn_ring_consumed(const epx__cuda_shape_t &s,
                                                     const epx_xn_ring_t &ring, int node,
                                                     int64_t j)
{
    __threadfence();
    __syncwarp();
    if (epx_lane() == 0)
        atomicAdd(ring.done + epx_xn_chunk_slot(s, node, j), 1u);
}

/*
 * Whether chunk `chunk` from node `node` (carrying `total` items this operation) has
 * landed entirely; an acquire, so the items may be read after it says 1.
 */
__device__ __forceinline__ int epx_xn_ring_arrived(const epx__cuda_shape_t &s,
                                                   const epx_xn_ring_t &ring, int node,
                                                   int64_t chunk, int64_t total)
{
    return epx_ld_acquire_sys(ring.arrived + epx_xn_chunk_slot(s, node, chunk * s.xn_chunk)) >=
           epx_xn_chunk_target(s, chunk, total);
}

/*
 * Give up a polling loop that saw no progress: 1 when this rank already failed, a peer
 * aborted, or `since` is more than the timeout ago (then a timeout naming `peer` at
 * `stage` is recorded). Lane 0 decides; every lane gets the answer.
 */
__device__ __forceinline__ int epx_xn_ring_give_up(const epx__cuda_shape_t &s, uint64_t since,
                                                   int stage, int peer)
{
    int stop = 0;
    if (epx_lane() == 0) {
        epx_fail_ctx_t c = epx_fail_ctx(s);
        if (epx_failed_ctx(c) || epx_check_abort(c, stage)) {
            stop = 1;
        } else if (epx_globaltimer() - since > (uint64_t)s.timeout_ns) {
            epx_record_failure_ctx(c, EPX_CUDA_FAIL_TIMEOUT, stage, peer, s.rank, 0, 0, 1);
            stop = 1;
        }
    }
    return __shfl_sync(0xffffffffu, stop, 0);
}

/*
 * The credit warp: for each channel into this rank (lane = its sender's node, two per
 * lane), walk its chunks in order; when one was consumed entirely, add its size to the
 * sender's credit counter `credit` (this rank's node's entry there), zeroing its two
 * counters first if no later chunk of this operation uses them. totals[n]: items node
 * n's partner sends here in this operation. Returns when every chunk is credited, or on
 * a failure (a timeout names the sender of a chunk still open).
 */
__device__ __forceinline__ void epx_xn_ring_credits(const epx__cuda_shape_t &s,
                                                    const epx_xn_ring_t &ring,
                                                    const int32_t *totals, int stage)
{
    const int N = s.num_nodes, my_node = epx_xn_node(s, s.rank), lane = epx_lane();
    int64_t head[2], chunks[2], total[2];
    int node[2];
    for (int i = 0; i < 2; i++) {
        node[i] = lane + 32 * i;
        total[i] = node[i] < N && node[i] != my_node ? totals[node[i]] : 0;
        chunks[i] = (total[i] + s.xn_chunk - 1) / s.xn_chunk;
        head[i] = 0;
    }
    uint64_t since = epx_globaltimer();
    for (;;) {
        int open = 0, moved = 0, peer = -1;
        for (int i = 0; i < 2; i++) {
            while (head[i] < chunks[i]) {
                const int64_t size = epx_xn_chunk_size(s, head[i], total[i]);
                const int64_t at = epx_xn_chunk_slot(s, node[i], head[i] * s.xn_chunk);
                if (*reinterpret_cast<volatile uint32_t *>(ring.done + at) <
                    epx_xn_chunk_target(s, head[i], total[i])) {
                    open = 1;
                    peer = epx_xn_partner(s, node[i]);
                    break;
                }
                if (head[i] + s.xn_ring / s.xn_chunk >= chunks[i]) {
                    /* The counters' last chunk in this operation: ready for the next. */
                    atomicExch(ring.done + at, 0u);
                    atomicExch(reinterpret_cast<unsigned long long *>(ring.arrived + at), 0ull);
                }
                epx_fence_acq_rel_sys(); /* the chunk's reads, before its credit goes back */
                epx_xn_test_sleep(s.xn_test_delay_ns, (uint64_t)at * 131 + (uint64_t)head[i]);
                nvshmemx_signal_op(ring.credit + my_node, (uint64_t)size, NVSHMEM_SIGNAL_ADD,
                                   epx_xn_partner(s, node[i]));
                head[i]++;
                moved = 1;
            }
        }
        const unsigned open_lanes = __ballot_sync(0xffffffffu, open);
        if (open_lanes == 0)
            return;
        if (__any_sync(0xffffffffu, moved)) {
            since = epx_globaltimer();
            continue;
        }
        peer = __shfl_sync(0xffffffffu, peer, __ffs(open_lanes) - 1);
        if (epx_xn_ring_give_up(s, since, stage, peer))
            return;
    }
}

#endif /* EPX_OPS_CUDA_NVSHMEM_XN_RING_CUH */
