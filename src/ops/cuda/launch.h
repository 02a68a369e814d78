/*
 * The CUDA backend's kernels as seen from host C: the memory layout every rank shares,
 * the argument structs of each kernel, and the extern "C" launchers (defined in the
 * .cu files beside this header).
 *
 * Memory of one rank (the same layout on every rank, so an offset names the same place
 * in every peer's allocation):
 *   shared  one cudaMalloc, exported by CUDA IPC and mapped by every peer of the node:
 *           a control area the peers write into (flags, count rows, abort word), then
 *           the receive region (token rows, fp8 scales, top-k ids and weights), the
 *           combine weights and the combine-input region (bf16 rows the caller fills
 *           with expert outputs, see epx_get_combine_input; no operation writes it).
 *           Peers write into it (dispatch) and read from it (combine).
 *   local   device memory only this rank touches: the operation epoch, grid counters,
 *           the device error flag, receive offsets, the peers' mapped base addresses.
 *   mapped  host memory mapped into the device (cudaHostAllocMapped): what the host
 *           waits on (the count exchange's results, stamped with a ticket) and the
 *           device error record the host turns into a status.
 *
 * Synchronisation: every collective operation has a sequence number seq = epoch + 1
 * (the epoch lives in device memory so that CUDA graph replays advance it too). A rank
 * signals a peer by storing seq into its own slot of the peer's control area with a
 * release store at system scope; the peer waits with acquire loads until the value is
 * at least seq. Every wait reads %globaltimer against the group's timeout.
 */
#ifndef EPX_OPS_CUDA_LAUNCH_H
#define EPX_OPS_CUDA_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Ranks one IPC domain may hold (a token's destinations are a 64-bit mask). */
#define EPX_CUDA_MAX_RANKS 64
/* Ranges combine may read in place besides the buffer: epx_buffer_register's
 * (EPX_MAX_REGISTERED), then the allocations mapped on demand (auto_register.c). */
#define EPX_CUDA_MAX_REGISTERED 8
#define EPX_CUDA_AUTO_SLOTS 8
#define EPX_CUDA_RANGE_ROWS (EPX_CUDA_MAX_REGISTERED + EPX_CUDA_AUTO_SLOTS)
/* Threads per block of the data kernels: 16 warps (the vector kernels: one token per
 * warp at a time; the staged dispatch: the store warps, its loader warps on top). */
#define EPX_CUDA_THREADS 512
/* Threads a block of the count exchange kernel (a fresh scan's tile: one token a thread
 * a round). */
#define EPX_CUDA_NOTIFY_THREADS 1024
/* Most blocks (tiles) a fresh count scan splits its tokens over. */
#define EPX_CUDA_SCAN_TILES 64
/* Largest expert count the count kernels keep in shared memory. */
#define EPX_CUDA_MAX_EXPERTS 8192

/*
 * Which single-node data kernels normal mode runs (EPX_NORMAL_KERNELS): the vector
 * kernels (dispatch.cu, combine.cu: 16-byte loads and stores from registers), the
 * bulk-copy kernels (dispatch_bulk.cu, combine_bulk.cu: TMA copies through rings in
 * shared memory), or the staged dispatch, the default (dispatch_staged.cu: loader warps
 * bulk-load rows into rings, store warps store them; combine as the vector form). A case
 * a form cannot take runs the vector kernels.
 */
enum { EPX_CUDA_KERNELS_VECTOR = 1, EPX_CUDA_KERNELS_BULK = 2, EPX_CUDA_KERNELS_STAGED = 3 };

/* Where a device-side wait or check was when it failed (named in host messages). */
typedef enum {
    EPX_CUDA_STAGE_NONE = 0,
    EPX_CUDA_STAGE_LAYOUT = 1,        /* get_dispatch_layout */
    EPX_CUDA_STAGE_NOTIFY = 2,        /* dispatch: count exchange */
    EPX_CUDA_STAGE_DISPATCH = 3,      /* dispatch: waiting for data */
    EPX_CUDA_STAGE_COMBINE_READY = 4, /* combine: waiting for peers' inputs */
    EPX_CUDA_STAGE_COMBINE_DONE = 5,  /* combine: waiting for peers to finish reading */
    /* Internode mode (several nodes): */
    EPX_CUDA_STAGE_FORWARD = 6,         /* dispatch: waiting for another node's tokens */
    EPX_CUDA_STAGE_COMBINE_ENTER = 7,   /* combine: waiting for a home rank to enter */
    EPX_CUDA_STAGE_COMBINE_PARTIAL = 8, /* combine: waiting for another node's sums */
    /* Internode mode with rings (EPX_XN_RING_TOKENS): */
    EPX_CUDA_STAGE_CREDIT = 9,          /* dispatch: waiting for ring slots on another node */
    EPX_CUDA_STAGE_COMBINE_CREDIT = 10, /* combine: waiting for ring slots on another node */
} epx__cuda_stage_t;

/* What the device error record says happened. */
typedef enum {
    EPX_CUDA_FAIL_NONE = 0,
    EPX_CUDA_FAIL_TIMEOUT = 1,    /* peer did not answer in time (peer = that rank) */
    EPX_CUDA_FAIL_ABORT = 2,      /* a peer published a failure (peer = culprit rank) */
    EPX_CUDA_FAIL_EXPERT_ID = 3,  /* this rank's topk_idx[index] = value is out of range */
    EPX_CUDA_FAIL_PEER_INPUT = 4, /* peer reported bad input in the count exchange */
    EPX_CUDA_FAIL_ROWS = 5,       /* combine: peer's x has `index` rows, row `value` needed */
} epx__cuda_fail_t;

/*
 * Abort word in a rank's control area, written by a failing peer: code (8 bits: 1 =
 * timeout, 2 = failure), stage (8 bits), reporter rank (24 bits), culprit rank + 1 (24
 * bits, never 0 when set).
 */
#define EPX_CUDA_ABORT_PACK(code, stage, reporter, culprit)                                \
    (((uint64_t)(code) << 56) | ((uint64_t)((stage) & 0xff) << 48) |                      \
     ((uint64_t)((reporter) & 0xffffff) << 24) | (uint64_t)(((culprit) + 1) & 0xffffff))
#define EPX_CUDA_ABORT_CODE(word) ((int)((word) >> 56))
#define EPX_CUDA_ABORT_STAGE(word) ((int)(((word) >> 48) & 0xff))
#define EPX_CUDA_ABORT_REPORTER(word) ((int)(((word) >> 24) & 0xffffff))
#define EPX_CUDA_ABORT_CULPRIT(word) ((int)((word) & 0xffffff) - 1)

/* One peer's slot in a rank's control area (written by that peer only). */
typedef struct {
    uint64_t count_flag[2]; /* count exchange done, per sequence parity */
    uint64_t data_flag;     /* dispatch: every row of this peer has landed */
    uint64_t ready_flag;    /* combine: the peer's input x is readable */
    uint64_t done_flag;     /* combine: the peer finished reading this rank's x */
    int64_t ready_offset;   /* combine: byte offset of the peer's x in its allocation */
    int64_t ready_stride;   /* combine: bytes between the peer's x rows */
    int64_t ready_rows;     /* combine: rows of the peer's x */
    int32_t status[2];      /* count exchange: the peer's input status, per parity */
    /* Internode mode: NVSHMEM signals from the peer of the same local rank on another
     * node (counters add one per record and only grow; the enter flag carries seq). */
    uint64_t xn_records;    /* dispatch: records of this peer's node that arrived */
    uint64_t xn_partials;   /* combine: partial sums from this peer's node that arrived */
    uint64_t xn_enter;      /* combine: this home rank entered combine seq */
    int32_t ready_region;   /* combine: 0: ready_offset is in the peer's shared
                               allocation; i + 1: in its registered range i */
    int32_t reserved[7];
} epx__cuda_slot_t;

/* Start of the control area. */
typedef struct {
    uint64_t abort_word; /* EPX_CUDA_ABORT_PACK, written by a failing peer */
    uint64_t abort_out;  /* internode: this rank's word as put to the abort_word of ranks
                            on other nodes (the put's symmetric source) */
    uint64_t reserved[14];
} epx__cuda_ctrl_t;

/*
 * One tile of a fresh count scan (layout.cu): its tokens per destination rank, then the
 * running total up to and including it, each published under `state` = seq * 4 +
 * EPX_CUDA_SCAN_AGGREGATE or EPX_CUDA_SCAN_PREFIX of the operation (no reset needed).
 */
enum { EPX_CUDA_SCAN_AGGREGATE = 1, EPX_CUDA_SCAN_PREFIX = 2 };
typedef struct {
    uint64_t state;
    int32_t aggregate[EPX_CUDA_MAX_RANKS];
    int32_t prefix[EPX_CUDA_MAX_RANKS];
} epx__cuda_scan_tile_t;

/* Device state only this rank touches. */
#define EPX_CUDA_GRID_COUNTERS 5
typedef struct {
    uint64_t epoch;                                 /* operations completed */
    uint32_t grid_counter[EPX_CUDA_GRID_COUNTERS];  /* last-block elections and token
                                                       tickets (EPX_CUDA_COUNTER_*) */
    int32_t failed;                                 /* nonzero: an error was recorded */
    int32_t reserved;
    int32_t base[EPX_CUDA_MAX_RANKS]; /* this rank's first row at each receiver */
    char *peers[EPX_CUDA_MAX_RANKS];  /* every rank's shared allocation, mapped here; NULL
                                         for ranks on other nodes (reached by NVSHMEM) */
    /* Internode mode: the xn_records / xn_partials totals already consumed, per node. */
    uint64_t xn_records_seen[EPX_CUDA_MAX_RANKS];
    uint64_t xn_partials_seen[EPX_CUDA_MAX_RANKS];
    /* Ranges read in place: registered[i][r] is rank r's range i as mapped here (NULL:
     * none, or not reached by CUDA IPC); rows 0.. are epx_buffer_register's slots, rows
     * EPX_CUDA_MAX_REGISTERED.. the allocations mapped on demand. */
    char *registered[EPX_CUDA_RANGE_ROWS][EPX_CUDA_MAX_RANKS];
    /* A fresh count scan over several blocks (layout.cu); the counters and sums are reset
     * by the scan's last block. */
    uint32_t scan_ticket;                       /* tiles handed out, in block start order */
    uint32_t scan_done;                         /* tiles finished (last-block election) */
    unsigned long long scan_first_bad;          /* lowest entry index with a bad id, or ~0 */
    int32_t scan_experts[EPX_CUDA_MAX_EXPERTS]; /* this rank's tokens per expert */
    epx__cuda_scan_tile_t scan_tiles[EPX_CUDA_SCAN_TILES];
} epx__cuda_local_t;

/* grid_counter's slots: the data kernels' last-block elections (reset by the last block),
 * and the single-node dispatch and combine kernels' token tickets (epx_ticket_take; zeroed
 * by the kernel before each on the stream: the count exchange, the ready exchange), and
 * the fan-out copy's row tickets (zeroed by a memset before it). */
enum {
    EPX_CUDA_COUNTER_DISPATCH = 0,
    EPX_CUDA_COUNTER_COMBINE = 1,
    EPX_CUDA_COUNTER_DISPATCH_TOKENS = 2,
    EPX_CUDA_COUNTER_COMBINE_TOKENS = 3,
    EPX_CUDA_COUNTER_FANOUT_ROWS = 4
};

/* Host memory mapped into the device. */
typedef struct {
    volatile uint64_t ticket; /* ticket of the last count exchange whose results are here */
    int64_t num_recv;         /* rows this rank receives */
    volatile int32_t error_code; /* epx__cuda_fail_t, written last */
    int32_t error_stage;
    int32_t error_peer;
    int32_t error_reporter;
    int64_t error_value;
    int64_t error_index;
    /* followed by int32 rank_counts[R * R] and int32 recv_per_expert[L] */
} epx__cuda_mapped_t;

/* Everything a kernel needs to find memory; identical on every rank but `rank`. */
typedef struct {
    int rank;
    int world_size;
    int num_experts;
    int num_local_experts;
    int num_topk;
    int reserved;
    int64_t hidden;
    int64_t max_recv;          /* rows of the receive region */
    int64_t timeout_ns;        /* every device wait gives up after this long */
    /* byte offsets inside every rank's shared allocation */
    int64_t off_slots;         /* [R] epx__cuda_slot_t */
    int64_t off_rank_counts;   /* [2][R][R] int32: row s written by rank s */
    int64_t off_expert_counts; /* [2][R][L] int32: row s written by rank s */
    int64_t off_x;             /* [max_recv] rows of x_pitch_max bytes */
    int64_t x_pitch_max;       /* bytes per receive row: hidden * 2 (bf16) */
    int64_t off_scales;        /* [max_recv][hidden / 128] fp32, -1 if hidden % 128 */
    int64_t off_topk_idx;      /* [max_recv][K] int64 */
    int64_t off_topk_weights;  /* [max_recv][K] fp32 */
    int64_t off_combine_weights; /* [max_recv][K] fp32: combine's topk_weights input */
    int64_t off_combine_input; /* [max_recv] bf16 rows of hidden: epx_get_combine_input */
    int64_t shared_bytes;
    /*
     * Internode mode (num_nodes > 1; the shared allocation is NVSHMEM symmetric memory,
     * see src/ops/cuda/internode.h). T = max_tokens_per_rank, N nodes, P ranks per node.
     */
    int ranks_per_node;        /* P (= world_size on one node) */
    int num_nodes;             /* N */
    int64_t max_tokens;        /* T */
    int64_t off_xn_counts;     /* [2][R][xn_count_cols] int32: row s written by rank s */
    int64_t off_xn_counts_out; /* [R][xn_count_cols] int32: this rank's messages, staged */
    int64_t xn_count_cols;     /* R rank counts, N node counts, L expert counts, status */
    int64_t off_xn_inbox;      /* [N][T] records from node n's rank of this local rank */
    int64_t off_xn_outbox;     /* [N][T] records for node n, staged for the put */
    int64_t xn_record_pitch;   /* bytes of a record slot (sized for bf16 rows) */
    int64_t off_xn_partial_in; /* [N][T] partial sums from node n (own node: by token) */
    int64_t off_xn_partial_out; /* [N][T] partial sums for node n's home ranks, staged */
    int64_t xn_partial_pitch;  /* bytes of a partial slot: bf16 row + K fp32 weights */
    int64_t xn_test_delay_ns;  /* EPX_XN_TEST_DELAY_NS: late, out-of-order puts (tests) */
    /*
     * Rings (EPX_XN_RING_TOKENS = C > 0, below T): the record and partial-sum slots are
     * [N][C] instead of [N][T], taken modulo C, and the receiver returns credits as they
     * drain (nvshmem/xn_ring.cuh). 0: the worst-case [N][T] slots, no credits.
     */
    int64_t xn_ring;           /* C, a power of two; 0 = no rings */
    int64_t xn_chunk;          /* G: records per put and per credit, divides C */
    int64_t off_xn_ring;       /* the rings' counters (epx__cuda_xn_ring_layout) */
    epx__cuda_local_t *local;
    uint64_t *trace;                 /* EPX_NORMAL_TRACE (below), or NULL */
    epx__cuda_mapped_t *mapped;      /* device address of the mapped block */
    int32_t *mapped_rank_counts;     /* [R * R] */
    int32_t *mapped_recv_per_expert; /* [L] */
} epx__cuda_shape_t;

/*
 * The normal-mode combine's phase trace (EPX_NORMAL_TRACE, one node, the vector kernel):
 * word 0 counts the combines traced, word 1 is the current one's record; then
 * EPX_NORMAL_TRACE_CALLS records (call c at c % CALLS) of EPX_NORMAL_TRACE_EVENTS
 * globaltimer times (ns), one clock for every process on the GPU.
 */
#define EPX_NORMAL_TRACE_CALLS 256
enum {
    EPX_NORMAL_TRACE_READY_START = 0, /* the ready kernel starts */
    EPX_NORMAL_TRACE_READY_DONE,      /* every peer's input published */
    EPX_NORMAL_TRACE_PULL_FIRST,      /* the pull kernel's first block starts */
    EPX_NORMAL_TRACE_PULL_LAST,       /* its last block starts */
    EPX_NORMAL_TRACE_ROWS_FIRST,      /* the first warp has summed its last token */
    EPX_NORMAL_TRACE_ROWS_LAST,       /* the last warp has */
    EPX_NORMAL_TRACE_DONE_START,      /* the last block starts the done exchange */
    EPX_NORMAL_TRACE_DONE_END,        /* and ends it */
    EPX_NORMAL_TRACE_EVENTS
};
#define EPX_NORMAL_TRACE_WORDS (2 + EPX_NORMAL_TRACE_CALLS * EPX_NORMAL_TRACE_EVENTS)

/* ---------------------------------------------------------------- layout */

typedef struct {
    const int64_t *topk_idx;
    int64_t topk_stride; /* elements between rows */
    int64_t num_tokens;
    int32_t *num_tokens_per_rank;   /* [R], zeroed before the kernel */
    int32_t *num_tokens_per_expert; /* [E], zeroed before the kernel */
    uint8_t *is_token_in_rank;      /* [T][R] or NULL */
    int64_t in_rank_stride;
} epx__cuda_layout_args_t;

cudaError_t epx__cuda_launch_layout(const epx__cuda_shape_t *shape,
                                    const epx__cuda_layout_args_t *args, int num_sms,
                                    cudaStream_t stream);

/* ---------------------------------------------------------------- internode routing */

/*
 * A dispatch's internode routing, in the handle's device memory (NULL on one node):
 * written by the fresh count exchange and the forwarding kernel, read by cached
 * dispatches and combines.
 */
typedef struct {
    int32_t *node_pos;   /* [T][N]: token's record index among this rank's records for
                            node n, or -1 (not sent there, or n is this rank's node) */
    int32_t *node_out;   /* [N]: records this rank sends to node n */
    int32_t *node_in;    /* [N]: records node n's rank of this local rank sends here */
    int32_t *fwd_rows;   /* [N][T][P]: for record j from node n, its row at each local
                            rank of this node, or -1 */
} epx__cuda_xn_routing_t;

#ifdef __CUDACC__
#define EPX_CUDA_HOST_DEVICE static __host__ __device__ __forceinline__
#else
#define EPX_CUDA_HOST_DEVICE static inline
#endif

/*
 * One internode record: a token on its way to another node, put as one message into
 * the same local rank there, which forwards it. Offsets from the record's start; the
 * x row first (bf16 or fp8), then fp32 scales (fp8), the token's top-k ids (int64,
 * global) and weights (fp32), and its row at each rank of the destination node
 * (int32, -1 = not there). Sized per dispatch, so an fp8 record moves no bf16 padding.
 */
typedef struct {
    int64_t scales, topk_idx, weights, rows, bytes;
} epx__cuda_xn_record_t;

EPX_CUDA_HOST_DEVICE epx__cuda_xn_record_t epx__cuda_xn_record(int64_t row_bytes, int num_scales,
                                                              int topk, int ranks_per_node)
{
    epx__cuda_xn_record_t r;
    r.scales = (row_bytes + 15) / 16 * 16;
    r.topk_idx = (r.scales + (int64_t)num_scales * 4 + 15) / 16 * 16;
    r.weights = r.topk_idx + (int64_t)topk * 8;
    r.rows = r.weights + (int64_t)topk * 4;
    r.bytes = (r.rows + (int64_t)ranks_per_node * 4 + 15) / 16 * 16;
    return r;
}

/*
 * The counters of the internode rings, as byte offsets from off_xn_ring, for N nodes and
 * B = C / G chunks per ring. Channel n of a counter array is the ring shared with the
 * rank of this local index on node n. Written by NVSHMEM signals from other nodes:
 * arrived [N][B] (records or partial sums that landed in each chunk of a ring, added
 * by the sender's put; zeroed by this rank after an operation's last use) and credit [N]
 * (records the rank on node n drained of this rank's, only grows). Only this rank's:
 * sent [N] (records put to node n before this operation, the base of the credits) and
 * done [N][B] (records of each chunk already consumed here, reset with arrived).
 */
typedef struct {
    int64_t dispatch_arrived, combine_arrived; /* uint64 [N][B] */
    int64_t dispatch_credit, combine_credit;   /* uint64 [N] */
    int64_t dispatch_sent, combine_sent;       /* uint64 [N] */
    int64_t dispatch_done, combine_done;       /* uint32 [N][B] */
    int64_t bytes;
} epx__cuda_xn_ring_layout_t;

EPX_CUDA_HOST_DEVICE epx__cuda_xn_ring_layout_t epx__cuda_xn_ring_layout(int64_t nodes,
                                                                        int64_t chunks)
{
    epx__cuda_xn_ring_layout_t l;
    int64_t counters = nodes * chunks * 8, per_node = nodes * 8;
    l.dispatch_arrived = 0;
    l.combine_arrived = counters;
    l.dispatch_credit = 2 * counters;
    l.combine_credit = l.dispatch_credit + per_node;
    l.dispatch_sent = l.combine_credit + per_node;
    l.combine_sent = l.dispatch_sent + per_node;
    l.dispatch_done = l.combine_sent + per_node;
    l.combine_done = l.dispatch_done + nodes * chunks * 4;
    l.bytes = l.combine_done + nodes * chunks * 4;
    return l;
}

/* ---------------------------------------------------------------- count exchange */

typedef struct {
    /* Fresh mode routes by topk_idx, or by is_token_in_rank (with the caller's
     * num_tokens_per_expert); both NULL in cached mode: only the entry signal is exchanged. */
    const int64_t *topk_idx;
    int64_t topk_stride;
    int64_t num_tokens;
    int32_t *send_row;        /* [T][R]: out, each token's ordinal at each rank or -1 */
    int32_t *recv_count;      /* handle: rows received (written in fresh mode) */
    int32_t *recv_per_expert; /* handle: [L], rounded up to the alignment */
    int expert_alignment;     /* 1 = none */
    int max_blocks;           /* the SM budget: a fresh scan uses at most this many blocks */
    uint64_t ticket;          /* nonzero: publish results to mapped memory, then ticket */
    /* Internode mode (handle state, see epx__cuda_xn_routing_t) */
    epx__cuda_xn_routing_t xn;
    const uint8_t *is_token_in_rank;      /* [T][R] bytes, nonzero = send */
    int64_t in_rank_stride;               /* elements between rows */
    const int32_t *num_tokens_per_expert; /* [E]: this rank's counts, with is_token_in_rank */
    int32_t *rank_prefix;     /* handle: [R][R] rank_prefix_matrix (written in fresh mode) */
} epx__cuda_notify_args_t;

cudaError_t epx__cuda_launch_notify(const epx__cuda_shape_t *shape,
                                    const epx__cuda_notify_args_t *args, cudaStream_t stream);

/*
 * A fresh count scan's grid: a block per round of EPX_CUDA_NOTIFY_THREADS tokens, at most
 * max_blocks (the SM budget) and EPX_CUDA_SCAN_TILES, each block then taking the same
 * number of whole rounds; so many blocks that none is left without tokens. At least one.
 */
EPX_CUDA_HOST_DEVICE int64_t epx__cuda_scan_blocks(int64_t num_tokens, int64_t max_blocks)
{
    const int64_t rounds = (num_tokens + EPX_CUDA_NOTIFY_THREADS - 1) / EPX_CUDA_NOTIFY_THREADS;
    int64_t most = max_blocks < EPX_CUDA_SCAN_TILES ? max_blocks : EPX_CUDA_SCAN_TILES;
    if (most < 1)
        most = 1;
    if (rounds < 1)
        return 1;
    const int64_t per = (rounds + most - 1) / most;
    return (rounds + per - 1) / per;
}

/* The tokens [*first, *end) of tile `tile` of a scan over `blocks` blocks. */
EPX_CUDA_HOST_DEVICE void epx__cuda_scan_tile(int64_t num_tokens, int64_t blocks, int64_t tile,
                                              int64_t *first, int64_t *end)
{
    const int64_t rounds = (num_tokens + EPX_CUDA_NOTIFY_THREADS - 1) / EPX_CUDA_NOTIFY_THREADS;
    const int64_t per = (rounds + blocks - 1) / blocks * EPX_CUDA_NOTIFY_THREADS;
    *first = tile * per < num_tokens ? tile * per : num_tokens;
    *end = *first + per < num_tokens ? *first + per : num_tokens;
}

/* ---------------------------------------------------------------- dispatch */

typedef struct {
    const void *x;
    int64_t x_stride;  /* bytes between rows */
    int64_t row_bytes; /* hidden * element size, a multiple of 16 */
    int64_t recv_pitch; /* bytes between rows in the receive region */
    int x_align;       /* largest of 16, 8, 4, 2, 1 dividing x and x_stride */
    int num_scales;    /* hidden / 128 when fp8, else 0 */
    const float *scales;
    int64_t scales_stride; /* elements between rows */
    const int64_t *topk_idx; /* NULL: no top-k outputs */
    int64_t topk_stride;
    const float *topk_weights; /* NULL: no weights output */
    int64_t weights_stride;
    int64_t num_tokens;
    int32_t *send_row; /* [T][R]; fresh: ordinals, turned into rows in place */
    int fresh;
    int num_blocks;
    epx__cuda_xn_routing_t xn; /* internode mode */
    int64_t scales_col_stride; /* elements between columns (column-major x_scales) */
    int kernels; /* EPX_CUDA_KERNELS_* (single node) */
    int num_sms; /* the SM budget (the bulk kernels choose their own block count) */
} epx__cuda_dispatch_args_t;

cudaError_t epx__cuda_launch_dispatch(const epx__cuda_shape_t *shape,
                                      const epx__cuda_dispatch_args_t *args,
                                      cudaStream_t stream);
/* The bulk-copy form; *launched = 0 (and nothing queued) when the case does not fit it. */
cudaError_t epx__cuda_launch_dispatch_bulk(const epx__cuda_shape_t *shape,
                                           const epx__cuda_dispatch_args_t *args,
                                           cudaStream_t stream, int *launched);
/* The staged form; *launched = 0 (and nothing queued) when the case does not fit it. */
cudaError_t epx__cuda_launch_dispatch_staged(const epx__cuda_shape_t *shape,
                                             const epx__cuda_dispatch_args_t *args,
                                             cudaStream_t stream, int *launched);

/* ---------------------------------------------------------------- combine */

typedef struct {
    const int32_t *send_row; /* [T][R] rows at each rank, -1 = not sent */
    int64_t num_tokens;
    void *out_x;
    int64_t out_stride;   /* bytes */
    int out_align;        /* alignment of out_x rows (16 = vector stores) */
    int has_weights;
    float *out_weights;
    int64_t out_weights_stride; /* elements */
    int64_t x_offset;     /* this rank's x: byte offset in its shared allocation, or in
                             its registered range x_region - 1 */
    int32_t x_region;     /* 0, or 1 + the registered range holding x */
    int64_t x_stride;     /* bytes, a multiple of 16 */
    int64_t x_rows;
    int num_blocks;
    int reserved;
    epx__cuda_xn_routing_t xn; /* internode mode */
    const void *bias[2];    /* [T] bf16 rows added first, or NULL */
    int64_t bias_stride[2]; /* bytes */
    int bias_align[2];      /* alignment of the bias rows (16 = vector loads) */
    int kernels; /* EPX_CUDA_KERNELS_* (single node) */
    int num_sms; /* the SM budget (the bulk kernels choose their own block count) */
    /* [T][num_topk] expert ids ordering each token's sum (combine_order.cuh), or NULL:
     * rank order. Single node only. */
    const int64_t *order_topk;
    int64_t order_stride; /* elements */
} epx__cuda_combine_args_t;

cudaError_t epx__cuda_launch_combine(const epx__cuda_shape_t *shape,
                                     const epx__cuda_combine_args_t *args, cudaStream_t stream);
/* The bulk-copy form of the pull kernel (after the ready kernel); *launched = 0 (and
 * nothing queued) when the case does not fit it. */
cudaError_t epx__cuda_launch_combine_bulk(const epx__cuda_shape_t *shape,
                                          const epx__cuda_combine_args_t *args,
                                          cudaStream_t stream, int *launched);

/* ---------------------------------------------------------------- local copies */

/*
 * Copy rows [0, n) of `row_bytes` each, n = rows, or min(rows, *rows_device) when
 * rows_device is given (a count only the device knows).
 */
typedef struct {
    const void *src;
    int64_t src_pitch;
    void *dst;
    int64_t dst_pitch;
    int64_t row_bytes;
    int64_t rows;
    const int32_t *rows_device;
} epx__cuda_copy_args_t;

cudaError_t epx__cuda_launch_copy(const epx__cuda_copy_args_t *args, int num_sms,
                                  cudaStream_t stream);

/* ---------------------------------------------------------------- fan-out copy (tools) */

/*
 * epx_fanout_copy (include/epx_tool.h): row i of src to ranks (rank + i + j) mod R for
 * j < k_i (epx__fanout_count of fanout_milli), at byte dst_offset + (first_row + i) *
 * dst_pitch of each one's shared allocation. No signals.
 */
typedef struct {
    const void *src;
    int64_t src_pitch;
    int64_t rows;
    int64_t row_bytes;
    int64_t fanout_milli;
    int64_t dst_offset;
    int64_t dst_pitch;
    int64_t first_row;
    int kernel;  /* EPX_FANOUT_* (include/epx_tool.h) */
    int num_sms;
    int stages;  /* bulk: slots per warp's ring; staged: slots of the block's ring; 0 = what
                  * EPX_BULK_RING_BYTES holds */
} epx__cuda_fanout_args_t;

cudaError_t epx__cuda_launch_fanout(const epx__cuda_shape_t *shape,
                                    const epx__cuda_fanout_args_t *args, cudaStream_t stream);

/* ---------------------------------------------------------------- fan-in sum (tools) */

/*
 * epx_fanin_reduce (include/epx_tool.h): row i of dst (at dst + i * dst_pitch) is the fp32
 * sum, rounded to bf16, of the rows at byte src_offset + (first_row + i) * src_pitch of
 * the shared allocations of ranks (rank + i + j) mod R for j < k_i (epx_fanout_count of
 * fanin_milli), in j order. No signals.
 */
typedef struct {
    void *dst;
    int64_t dst_pitch;
    int64_t rows;
    int64_t row_bytes;
    int64_t fanin_milli;
    int64_t src_offset;
    int64_t src_pitch;
    int64_t first_row;
    int kernel; /* EPX_FANIN_* (include/epx_tool.h) */
    int num_sms;
} epx__cuda_fanin_args_t;

cudaError_t epx__cuda_launch_fanin(const epx__cuda_shape_t *shape,
                                   const epx__cuda_fanin_args_t *args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_OPS_CUDA_LAUNCH_H */
