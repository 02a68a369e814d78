/*
 * The CUDA backend's low-latency mode: the interface between libepx (host side,
 * src/ops/cuda/ll_*.c) and the kernels of the NVSHMEM plugin libepx_nvshmem.so
 * (src/ops/cuda/nvshmem/). The plugin's NVSHMEM set-up is the transport's
 * (src/transport/nvshmem/), which loads the library; the backend finds this table in it.
 *
 * Why a plugin: NVSHMEM device code needs relocatable device code, a device link step
 * and NVSHMEM's host library at run time. Keeping all of it in one library that epx
 * loads with dlopen() when a low-latency CUDA buffer is created means libepx.so loads
 * (and everything else works) on machines without NVSHMEM, and the normal-mode kernels
 * keep their whole-program optimisation.
 *
 * Memory of one rank (M = max_low_latency_tokens, R ranks, L local experts, k top-k,
 * S = hidden / 128 scale columns, cells = L * R * M; a row is hidden bytes when the config
 * says low_latency_dtype = fp8, else 2 * hidden):
 *   symmetric heap (nvshmem_malloc; peers write it, same offsets on every rank)
 *     flags      uint64 [4 kinds][2 slots][R], sequence numbers (never cleared)
 *     per slot:  sent_count int32 [L][R] (rows each source sent each local expert);
 *                recv_x [cells][row], recv_scales [cells][S] fp32 (or [cells][hidden/512]
 *                packed UE8M0 words), recv_src_info and recv_topk int32 [cells]: source s
 *                writes its i-th row for expert e into cell (e * R + s) * M + i, and the
 *                receive packs the cells in place into rows e * R * M + j (the dispatch
 *                results, so no second copy of the rows exists); recv_range int64 [L][R]
 *                (peers read it to find their rows in combine_in); combine_in bf16
 *                [L][M*R][hidden] (the zero-copy combine input: peers read it in place);
 *                when NVSHMEM puts may be needed (groups across nodes, or forced):
 *                combine_stage bf16 [M][k][hidden], send_x [M][row] + send_scales
 *                [M][S] (rows staged for puts).
 *   device memory (cudaMalloc; this rank only)
 *     per slot:  recv_count [L]; recv_src_rank int32 [L][M*R]; send_pos int32 [M][k] (row
 *                i of each (token, expert) sent, in its source's cells at the receiver)
 *     state:     seq uint64 [2 slots][2] (dispatch, combine; advanced by the send
 *                kernels so CUDA graph replays keep counting), released uint64 [2] (the
 *                last dispatch of the slot whose results this rank gave back), combined
 *                uint64 [2] (kernels 2: the slot's dispatch at its last combine), arrive
 *                uint32 [2][4] (last-block counters), mask int32 [R] (+ the failure
 *                record's two claim words).
 *   host-mapped: the failure record.
 *
 * Because peers write a slot's dispatch results directly, a rank gives a slot back
 * ("released", DISPATCH_DONE flags) only once it is done with them: when it sends the
 * step's combine, or else when it dispatches into that slot again.
 *
 * Kernels 2 (EPX_LL_KERNELS=2, src/ops/cuda/nvshmem/ll2_*.cu) place every row once, at
 * its packed place: recv_x, recv_scales, recv_src_info and recv_topk are indexed by the
 * packed row e * M * R + j directly (the same arrays, no cells), and per slot they add
 *   symmetric: counts uint64 [R sources][E + 1] (tagged words: the count exchange),
 *              arrival uint64 [R] (dispatch units that arrived from each source) and
 *              combine_arrival uint64 [R] (combine rows pushed by each expert rank), both
 *              cumulative and never cleared; when puts may be needed, count_stage uint64
 *              [R][E + 1] and the rows staged for puts in the receivers' order, put_x
 *              [M * k][row], put_scales [M * k][S], put_src and put_topk int32 [M * k]
 *              (instead of send_x / send_scales, and no sent_count);
 *   device:    per slot sent_rows int32 [R] (rows this rank sent each rank: what a combine
 *              pushes back); state arrived and combine_arrived uint64 [2 slots][R] (how
 *              far this rank has counted each peer's arrival counters).
 */
#ifndef EPX_OPS_CUDA_LL_PLUGIN_H
#define EPX_OPS_CUDA_LL_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include "ops/cuda/launch.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 9: the internode kernels take biases and routing by the layout (libepx no longer
 * refuses them across nodes, so an older plugin must not be loaded). 10: xn_tell.
 * 11: epx__cuda_combine_args_t grew (order_topk, order_stride). 12: epx_ll_op_t grew
 * (wait_stats). 13: epx_ll_shape_t grew (release, combined: EPX_LL_RELEASE). */
#define EPX_LL_PLUGIN_ABI 13
#define EPX_LL_PLUGIN_SYMBOL "epx_ll_plugin_v1"

enum { EPX_LL_KIND_DISPATCH = 0, EPX_LL_KIND_DISPATCH_DONE = 1, EPX_LL_KIND_COMBINE = 2,
       EPX_LL_KIND_COMBINE_DONE = 3 };

/* Where a wait gave up (the failure record's stage). */
enum {
    EPX_LL_STAGE_DISPATCH_RELEASE = 1, /* dispatch send: receivers releasing the slot */
    EPX_LL_STAGE_DISPATCH = 2,         /* dispatch receive: tokens */
    EPX_LL_STAGE_COMBINE_RELEASE = 3,  /* combine send: home ranks releasing the slot */
    EPX_LL_STAGE_COMBINE = 4,          /* combine receive: expert outputs */
    EPX_LL_STAGE_DISPATCH_COUNTS = 5   /* dispatch (kernels 2): the peers' row counts */
};

/* Which phases a kernels-2 launch runs (both: a call without EPX_LL_SEND_ONLY). */
enum { EPX_LL_RUN_SEND = 1, EPX_LL_RUN_RECV = 2 };

/* Written by a kernel (code last) the first time a wait gives up, and (bad_id last) the
 * first time a kernel finds an expert id out of range; read by the host. Each has its
 * own claim word (mask[R], mask[R + 1]), so a bad id never hides a later lost peer. */
typedef struct {
    int32_t code; /* 0 none, 1 timeout */
    int32_t stage;
    int32_t peer;
    int32_t reported;     /* host: this record was already turned into a status */
    int32_t bad_id;       /* 1: topk_idx[bad_index] = bad_value is out of range */
    int32_t bad_stage;    /* EPX_LL_STAGE_DISPATCH or _COMBINE: whose argument */
    int32_t bad_reported; /* host: turned into a status */
    int32_t pad;
    int64_t bad_index;    /* token * num_topk + position */
    int64_t bad_value;
} epx_ll_fail_t;

/* Everything the kernels know about a buffer (passed by value to every kernel). */
typedef struct {
    int rank, world, num_local, num_experts, topk;
    int blocks;       /* the SM budget: grid size of every kernel */
    int kernels;      /* 1: cells packed by the receive; 2: rows placed once (ll2_*.cu) */
    int combine_recv; /* kernels 2: the combine receive's loads (EPX_LL_COMBINE_RECV, 1-2) */
    int release;      /* kernels 2: how slots are given back (EPX_LL_RELEASE: 1 flags, 2 inferred) */
    int stages;       /* kernels 2: the combine receive's copy stages (shared memory; 0 for
                         loads into registers) */
    int use_puts;     /* some peer needs NVSHMEM puts (no direct pointer), or forced */
    int may_put;      /* the plan reserved memory for puts (groups across nodes, or forced) */
    int64_t hidden, max_tokens, rows, scale_cols; /* rows = M * R */
    int64_t timeout_ns;
    size_t x_row_bytes; /* a cell of recv_x as sized: hidden * 2, or hidden (fp8 only) */
    /* symmetric heap */
    char *sym;          /* this rank's base */
    char *const *peer;  /* device array [R]: peer r's base for direct stores, or NULL */
    size_t flags;
    size_t slot[2];
    size_t sent_count, recv_x, recv_scales, recv_src_info, recv_topk, recv_range, combine_in;
    size_t combine_stage, send_x, send_scales; /* empty unless puts may be needed */
    size_t counts, arrival, combine_arrival;   /* kernels 2 */
    size_t count_stage, put_x, put_scales, put_src, put_topk; /* kernels 2, puts only */
    /* device memory */
    char *local[2];
    size_t recv_count, recv_src_rank, send_pos;
    size_t sent_rows; /* kernels 2 */
    size_t local_slot_bytes;
    uint64_t *seq;      /* [2 slots][2] */
    uint64_t *released; /* [2 slots] */
    uint64_t *combined; /* [2 slots] kernels 2: the slot's dispatch seq at its last combine */
    uint32_t *arrive;   /* [2 slots][4] */
    int32_t *mask;      /* [R], then the claims of the failure record's two parts */
    uint64_t *arrived;         /* kernels 2: [2 slots][R] */
    uint64_t *combine_arrived; /* kernels 2: [2 slots][R] */
    epx_ll_fail_t *fail; /* device address of the host-mapped record */
    uint64_t *trace;     /* kernels 2: phase times (EPX_LL_TRACE, below), or NULL: off */
} epx_ll_shape_t;

/*
 * The phase trace (EPX_LL_TRACE, a developers' tool; docs/LOW_LATENCY.md, "Where a step's
 * time goes"): kernels 2 record the GPU's global timer (ns, one clock for every process on
 * the GPU) as thread 0 of each block passes each phase, for the last EPX_LL_TRACE_CALLS
 * operations of each kind. Layout of shape.trace, u64: times [calls][2 kinds][blocks]
 * [EPX_LL_TRACE_EVENTS] (0: not reached), then ids [calls][2 kinds] (seq * 2 + slot + 1 of
 * the operation whose times are there; 0: none). Operation (seq, slot) lives at call
 * (seq * 2 + slot) % EPX_LL_TRACE_CALLS, so every rank keeps the same operations at the
 * same places.
 */
#define EPX_LL_TRACE_CALLS 256
#define EPX_LL_TRACE_EVENTS 10
enum { EPX_LL_TRACE_DISPATCH = 0, EPX_LL_TRACE_COMBINE = 1 };
/* Dispatch events (the receive's three are block 0's). */
enum {
    EPX_LL_TR_D_START = 0,     /* kernel entered */
    EPX_LL_TR_D_ROUTED = 1,    /* the routing in shared memory (ids, duplicates marked) */
    EPX_LL_TR_D_RELEASED = 2,  /* receivers gave the slot back */
    EPX_LL_TR_D_PUBLISHED = 3, /* this rank's counts published */
    EPX_LL_TR_D_BASE = 4,      /* the lower ranks' counts in (the count exchange) */
    EPX_LL_TR_D_STORED = 5,    /* the block's rows stored */
    EPX_LL_TR_D_SENT = 6,      /* arrival counted (last block: puts issued too) */
    EPX_LL_TR_D_COUNTS = 7,    /* receive: every source's counts read */
    EPX_LL_TR_D_BOOKED = 8,    /* receive: recv_count, the layout and the rows' sources written */
    EPX_LL_TR_D_ARRIVED = 9    /* receive: every source's rows arrived */
};
/* Combine events. */
enum {
    EPX_LL_TR_C_START = 0,    /* kernel entered */
    EPX_LL_TR_C_RELEASED = 1, /* send: homes gave the slot back (block 0) */
    EPX_LL_TR_C_SIGNALLED = 2,/* send: "outputs ready" raised (block 0) */
    EPX_LL_TR_C_ROUTED = 3,   /* receive: first routing batch in shared memory */
    EPX_LL_TR_C_READY = 4,    /* receive: every expert rank's outputs ready */
    EPX_LL_TR_C_REDUCED = 5,  /* receive: the block's tokens summed and stored */
    EPX_LL_TR_C_DONE = 6      /* the last block told the expert ranks */
};


/* One operation's arguments (device addresses; strides in elements). */
typedef struct {
    int slot;
    int64_t tokens;
    const void *x;          /* dispatch: bf16 [tokens][hidden]; combine: bf16 [L][M*R][hidden] */
    int64_t x_stride;
    const int64_t *topk_idx;
    int64_t idx_stride;
    const float *weights;   /* combine */
    int64_t weight_stride;
    void *out;              /* combine: bf16 [tokens][hidden] */
    int64_t out_stride;
    int use_fp8, round_scale, use_ue8m0;
    int32_t *recv_stats;    /* dispatch receive: [L] int32 += recv_count, or NULL */
    /* Receive, kernels 2: [R] int64 += ns from the receive's start until each unmasked
     * peer's data arrived (wait_recv_cost_stats), or NULL. */
    int64_t *wait_stats;
} epx_ll_op_t;

/* The kernels (stream-ordered; each returns a cudaError_t as int). */
typedef struct {
    int abi; /* EPX_LL_PLUGIN_ABI */
    int (*dispatch_send)(const epx_ll_shape_t *shape, const epx_ll_op_t *op, void *stream);
    int (*dispatch_recv)(const epx_ll_shape_t *shape, const epx_ll_op_t *op, void *stream);
    int (*combine_send)(const epx_ll_shape_t *shape, const epx_ll_op_t *op, void *stream);
    int (*combine_recv)(const epx_ll_shape_t *shape, const epx_ll_op_t *op, void *stream);
    /* Internode normal mode (src/ops/cuda/internode.h): the count exchange, dispatch
     * (send + forward) and combine (ready + reduce + finish) on a normal-mode shape whose
     * shared allocation is symmetric. Stream-ordered; return a cudaError_t as int. */
    int (*xn_notify)(const epx__cuda_shape_t *shape, const epx__cuda_notify_args_t *args,
                     void *stream);
    int (*xn_dispatch)(const epx__cuda_shape_t *shape, const epx__cuda_dispatch_args_t *args,
                       void *stream);
    int (*xn_combine)(const epx__cuda_shape_t *shape, const epx__cuda_combine_args_t *args,
                      void *stream);
    /* Kernels 2: one launch runs the phases `run` asks for (EPX_LL_RUN_*). */
    int (*dispatch2)(const epx_ll_shape_t *shape, const epx_ll_op_t *op, int run, void *stream);
    int (*combine2)(const epx_ll_shape_t *shape, const epx_ll_op_t *op, int run, void *stream);
    /* Kernels 2, once per buffer before its first launch (not stream-ordered): sets
     * shape->stages to what the device's shared memory holds, and the kernel attribute. */
    int (*prepare)(epx_ll_shape_t *shape);
    /* Internode normal mode: put this rank's `*source` into rank `pe`'s `abort_word`
     * (symmetric addresses in the shared allocation's control area), stream-ordered. */
    int (*xn_tell)(uint64_t *abort_word, const uint64_t *source, int pe, void *stream);
} epx_ll_plugin_t;

typedef const epx_ll_plugin_t *(*epx_ll_plugin_entry_t)(void);

/*
 * Shared memory of the kernels, computed where they launch and where the plan checks
 * that a config fits (ll_setup.c): one formula for both.
 */
#ifdef __CUDACC__
#define EPX_LL_HOST_DEVICE static __host__ __device__ __forceinline__
#else
#define EPX_LL_HOST_DEVICE static inline
#endif

/* Words of the phase trace of a buffer whose kernels run `blocks` blocks. */
EPX_LL_HOST_DEVICE size_t epx_ll_trace_words(int blocks)
{
    return (size_t)EPX_LL_TRACE_CALLS * 2 * ((size_t)blocks * EPX_LL_TRACE_EVENTS + 1);
}

/* Tokens a send block places at a time (bounded so shared memory stays small). */
EPX_LL_HOST_DEVICE int epx_ll_chunk_tokens(int topk)
{
    int c = 1024 / topk;
    return c < 1 ? 1 : (c > 32 ? 32 : c);
}

/* Routing entries the send kernel copies to shared memory (else it reads them in place). */
#define EPX_LL_CACHED_ENTRIES 2048

EPX_LL_HOST_DEVICE int epx_ll_cache_routing(int64_t tokens, int topk)
{
    return tokens * topk <= EPX_LL_CACHED_ENTRIES;
}

/*
 * Shared memory of the send kernel, 8-byte items first: the routing when cached (int64),
 * the chunk's destinations (row and scales pointers, [2][C*k]); then int32: hist [E],
 * chunk experts + rows [2][C*k], ok [R].
 */
EPX_LL_HOST_DEVICE size_t epx_ll_send_smem(int experts, int topk, int world, int64_t tokens)
{
    size_t entries = (size_t)epx_ll_chunk_tokens(topk) * (size_t)topk;
    size_t routing = epx_ll_cache_routing(tokens, topk) ? (size_t)(tokens * topk) * 8 : 0;
    return routing + 2 * entries * 8 +
           ((size_t)experts + 2 * entries + (size_t)world) * sizeof(int32_t);
}

/* Shared memory of the receive kernel: ok [R], first rows [L][R + 1], [L + 1]. */
EPX_LL_HOST_DEVICE size_t epx_ll_recv_smem(int local, int world)
{
    return ((size_t)world + (size_t)local * ((size_t)world + 2) + 1) * sizeof(int32_t);
}

/* ---------------------------------------------------------------- kernels 2 */

/* Kernels 2 serve num_topk up to this (the combine's routing groups); else kernels 1. */
#define EPX_LL2_MAX_TOPK 32
/* Routing entries the kernels-2 dispatch send caches in shared memory (else read in place). */
#define EPX_LL2_CACHED_ENTRIES 2048
/* Tokens of a combine receive's routing batch (their entries live in shared memory). */
#define EPX_LL2_ROUTE_TOKENS 32
/* Rows a combine receive lane copies per pipeline stage (16 bytes of each). */
#define EPX_LL2_STAGE_ROWS 8
/* Most copy stages a combine receive warp may have (EPX_LL_COMBINE_RECV 1). */
#define EPX_LL2_MAX_STAGES 3

/* Tokens a kernels-2 send block places at a time. */
EPX_LL_HOST_DEVICE int epx_ll2_chunk_tokens(int topk)
{
    int c = 512 / topk;
    return c < 1 ? 1 : (c > 32 ? 32 : c);
}

/*
 * Shared memory of a kernels-2 dispatch launch running `run` (EPX_LL_RUN_*): the send
 * part (8-byte items first: the chunk's destinations [2][C*k]; then int32: the routing
 * cache, hist, before, base, put_first [E], chunk experts and rows [2][C*k], ok,
 * rows_block, rows_to, batches_to [R]) and the receive part (int32 from the start:
 * counts [L][R], first [L][R + 1], rows_before [L + 1], units, failed [R]) share it: the
 * receive runs after the send in one block.
 */
EPX_LL_HOST_DEVICE size_t epx_ll2_dispatch_smem(int experts, int topk, int world, int run)
{
    size_t entries = (size_t)epx_ll2_chunk_tokens(topk) * (size_t)topk;
    size_t send = 2 * entries * 8 + ((size_t)EPX_LL2_CACHED_ENTRIES + 4 * (size_t)experts +
                                     2 * entries + 4 * (size_t)world) * sizeof(int32_t);
    size_t local = (size_t)experts / (size_t)(world > 0 ? world : 1);
    size_t recv = (local * (size_t)world + local * ((size_t)world + 1) + local + 1 +
                   2 * (size_t)world) * sizeof(int32_t);
    if (!(run & EPX_LL_RUN_SEND))
        return recv;
    return send > recv ? send : recv;
}

/* Threads of a kernels-2 block (the kernels' launch bounds; ll2_device.cuh). */
#define EPX_LL2_THREADS 512

/*
 * Shared memory of the kernels-2 combine: the receive's copy stages ([warps][stages]
 * [EPX_LL2_STAGE_ROWS][32 lanes] of 16 bytes), then one routing batch (row addresses
 * uint64, experts int32 and weights float per entry; valid entries int32 per token), then
 * ok [R]; the send part's expert_first [L + 1] reuses the start.
 */
EPX_LL_HOST_DEVICE size_t epx_ll2_combine_stage_bytes(int stages)
{
    /* 0: the receive loads into registers (EPX_LL_COMBINE_RECV 2), no stages. */
    return stages <= 0 ? 0 : (size_t)(EPX_LL2_THREADS / 32) * (size_t)stages * EPX_LL2_STAGE_ROWS * 32 * 16;
}

EPX_LL_HOST_DEVICE size_t epx_ll2_combine_smem(int experts, int topk, int world, int stages,
                                               int run)
{
    size_t entries = (size_t)EPX_LL2_ROUTE_TOKENS * (size_t)topk;
    size_t recv = epx_ll2_combine_stage_bytes(stages) + entries * (8 + 4 + 4) +
                  (size_t)EPX_LL2_ROUTE_TOKENS * 4 + (size_t)world * 4;
    size_t send = ((size_t)experts / (size_t)(world > 0 ? world : 1) + 1 + (size_t)world) * 4;
    if (!(run & EPX_LL_RUN_RECV))
        return send;
    return recv > send ? recv : send;
}

#ifdef __cplusplus
}
#endif

#endif /* EPX_OPS_CUDA_LL_PLUGIN_H */
