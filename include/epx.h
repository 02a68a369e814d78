/*
 * epx — expert-parallel exchange for Mixture-of-Experts.
 *
 * The whole public C API. Plain C11, usable from C++ (extern "C").
 *
 * Objects:
 *   epx_group_t   ranks that talk to each other (rank, world size, backend, device)
 *   epx_buffer_t  communication memory sized from one MoE shape; runs the operations
 *   epx_handle_t  the routing of one dispatch, reused by combine and cached dispatch
 *
 * Conventions:
 *   - Every entry point returns epx_status_t. Nothing asserts, aborts or exits.
 *   - Outputs are written only on success. epx_last_error() gives a message for the
 *     last failure on the calling thread (which rank, which stage, what was wrong).
 *   - Struct sizes, one policy for every struct that crosses the API (configs,
 *     arguments, results, infos): it starts with `size_t size`, which its *_INIT macro
 *     sets to sizeof the struct in this header, and every entry point checks it before
 *     reading or writing the struct. A size the library does not know is
 *     EPX_ERR_INVALID_ARG. A struct that grew between releases also accepts its earlier
 *     sizes (listed at the struct); the fields past such a size take their defaults.
 *   - Operations on a buffer are collective: every rank of the group calls them in the
 *     same order. If one rank fails inside an operation, the others return
 *     EPX_ERR_REMOTE naming that rank (or EPX_ERR_TIMEOUT if it stops answering) and
 *     the buffer is then unusable (every later call returns the first error).
 *     Exception: a call refused for its form (EPX_ERR_INVALID_ARG from the checks of this
 *     rank's own arguments: a struct size, a missing or extra tensor, a dtype or shape,
 *     a stale handle) has no effect on the rank that made it; when every rank made the
 *     same mistake the buffer stays usable on all. The peers that did enter the call get
 *     EPX_ERR_REMOTE naming the rank and fail as above (on the CUDA backend the refusing
 *     rank's buffer fails too). Errors that depend on the rank's data (EPX_ERR_CAPACITY,
 *     expert ids out of range) fail the buffer like any other failure.
 *   - A group, buffer or handle that was destroyed (or never made by epx) is refused with
 *     EPX_ERR_INVALID_ARG wherever it is passed, destroying it again included; the
 *     library never reads the object to find out (it keeps a set of live objects).
 *   - `stream` is a cudaStream_t for the CUDA backend (NULL = default stream) and is
 *     ignored by the host backend.
 */
#ifndef EPX_H
#define EPX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 1
#define EPX_VERSION_PATCH 0
#define EPX_VERSION_CODE (EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH)

/* Library version at run time (EPX_VERSION_CODE of the built library). */
int epx_version(void);

/* ---------------------------------------------------------------- status */

/* X(name, value, description). One list: the enum, names and strings come from it. */
#define EPX_STATUS_MAP(X)                                                              \
    X(SUCCESS, 0, "success")                                                           \
    X(ERR_INVALID_ARG, 1, "invalid argument")                                          \
    X(ERR_INVALID_STATE, 2, "call not valid in the current state")                     \
    X(ERR_OUT_OF_MEMORY, 3, "out of memory")                                           \
    X(ERR_CAPACITY, 4, "more tokens than the buffer or output was sized for")          \
    X(ERR_UNSUPPORTED, 5, "not supported by this backend or build")                    \
    X(ERR_SYSTEM, 6, "operating system call failed")                                   \
    X(ERR_CUDA, 7, "CUDA call failed")                                                 \
    X(ERR_NVSHMEM, 8, "NVSHMEM call failed")                                           \
    X(ERR_BOOTSTRAP, 9, "rendezvous between ranks failed")                             \
    X(ERR_TIMEOUT, 10, "a peer rank did not answer within the timeout")                \
    X(ERR_REMOTE, 11, "a peer rank failed or exited")                                  \
    X(ERR_INTERNAL, 12, "internal error (a bug in epx)")

typedef enum {
#define EPX_STATUS_ENUM_(name, value, text) EPX_##name = value,
    EPX_STATUS_MAP(EPX_STATUS_ENUM_)
#undef EPX_STATUS_ENUM_
} epx_status_t;

/* "invalid argument", ...; "unknown status" for values outside the list. */
const char *epx_status_string(epx_status_t status);
/* "EPX_ERR_INVALID_ARG", ... */
const char *epx_status_name(epx_status_t status);
/* Message of the last failure on this thread ("" if none). Valid until the next call. */
const char *epx_last_error(void);

/* ---------------------------------------------------------------- tensors */

typedef enum {
    EPX_DTYPE_INVALID = 0,
    EPX_DTYPE_BF16 = 1,
    EPX_DTYPE_FP8_E4M3 = 2,
    EPX_DTYPE_FP32 = 3,
    EPX_DTYPE_INT64 = 4,
    EPX_DTYPE_INT32 = 5,
    EPX_DTYPE_BOOL = 6, /* one byte, 0 or 1 */
} epx_dtype_t;

/* Bytes per element (0 for EPX_DTYPE_INVALID or unknown values). */
size_t epx_dtype_size(epx_dtype_t dtype);
const char *epx_dtype_name(epx_dtype_t dtype);

#define EPX_MAX_DIMS 3

/*
 * A tensor view: pointer, dtype, shape, strides in elements.
 * strides[i] == 0 for every i means contiguous (row major). Rows may be strided
 * (strides[0] >= row length); the innermost dimension must be contiguous.
 * data == NULL means "not given" for optional arguments.
 */
typedef struct {
    void *data;
    epx_dtype_t dtype;
    int32_t ndim;
    int64_t shape[EPX_MAX_DIMS];
    int64_t strides[EPX_MAX_DIMS];
} epx_tensor_t;

#define EPX_TENSOR_NONE {NULL, EPX_DTYPE_INVALID, 0, {0, 0, 0}, {0, 0, 0}}

/* Convenience constructors for contiguous tensors. */
epx_tensor_t epx_tensor_1d(void *data, epx_dtype_t dtype, int64_t n);
epx_tensor_t epx_tensor_2d(void *data, epx_dtype_t dtype, int64_t rows, int64_t cols);

/* ---------------------------------------------------------------- groups */

typedef struct epx_group *epx_group_t;
typedef struct epx_buffer *epx_buffer_t;
typedef struct epx_handle *epx_handle_t;

typedef enum {
    EPX_BACKEND_AUTO = 0, /* cuda when built with CUDA and a GPU is visible, else host */
    EPX_BACKEND_HOST = 1, /* CPU: ranks are processes sharing POSIX shared memory */
    EPX_BACKEND_CUDA = 2, /* GPU: CUDA IPC inside a node, NVSHMEM across nodes */
} epx_backend_t;

const char *epx_backend_name(epx_backend_t backend);

/* Out-of-band rendezvous identity, made by one rank and given to all (text inside). */
#define EPX_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[EPX_UNIQUE_ID_BYTES];
} epx_unique_id_t;

/* Make an id: rank 0's address (EPX_BOOTSTRAP_ADDR or this host) and a free port. */
epx_status_t epx_get_unique_id(epx_unique_id_t *id);
/* The id as printable text (for an environment variable) and back. */
epx_status_t epx_unique_id_to_string(const epx_unique_id_t *id, char *text, size_t text_size);
epx_status_t epx_unique_id_from_string(const char *text, epx_unique_id_t *id);

/*
 * Caller-supplied collectives (for frameworks that have their own process group).
 * allgather: every rank contributes `bytes` at `send`; `recv` receives world_size * bytes,
 * rank i's contribution at offset i * bytes. Return 0 on success, nonzero on failure.
 */
typedef struct {
    int (*allgather)(void *ctx, const void *send, void *recv, size_t bytes);
    int (*barrier)(void *ctx);
    void *ctx;
} epx_bootstrap_callbacks_t;

typedef struct {
    size_t size;                 /* sizeof(epx_group_config_t) */
    int rank;                    /* 0..world_size-1 */
    int world_size;              /* >= 1 */
    epx_backend_t backend;       /* default EPX_BACKEND_AUTO */
    int device;                  /* CUDA device; -1 = local rank modulo visible devices */
    int ranks_per_node;          /* ranks of a node (NVLink/IPC domain); 0 = EPX_RANKS_PER_NODE
                                    when set, else the ranks on each host (docs/INTERNODE.md) */
    const epx_unique_id_t *unique_id;             /* either this ... */
    const epx_bootstrap_callbacks_t *callbacks;   /* ... or this */
    int64_t timeout_ms;          /* 0 = EPX_TIMEOUT_MS */
} epx_group_config_t;

#define EPX_GROUP_CONFIG_INIT {sizeof(epx_group_config_t), 0, 1, EPX_BACKEND_AUTO, -1, 0, NULL, NULL, 0}

/* Collective: every rank calls it with the same world size and id (or callbacks). */
epx_status_t epx_group_create(const epx_group_config_t *config, epx_group_t *group);
/*
 * From the environment `epx launch` sets (EPX_RANK, EPX_WORLD_SIZE, EPX_UNIQUE_ID,
 * EPX_LOCAL_RANK, EPX_RANKS_PER_NODE; EPX_BACKEND when `backend` is AUTO), read at this
 * call, so variables set with setenv after an earlier epx call count. A process where
 * none of EPX_RANK, EPX_WORLD_SIZE and EPX_UNIQUE_ID is set becomes a group of one; one
 * where only some are set is refused with EPX_ERR_INVALID_ARG naming what is missing.
 */
epx_status_t epx_group_create_from_env(epx_backend_t backend, epx_group_t *group);
/*
 * Local, except for the group whose first low-latency CUDA buffer set NVSHMEM up: there
 * every rank must call it (after destroying its buffers), and it finalises NVSHMEM when
 * all ranks agree, within the group's timeout; NVSHMEM cannot be set up again in the
 * process afterwards.
 */
epx_status_t epx_group_destroy(epx_group_t group);

typedef struct {
    size_t size; /* sizeof(epx_group_info_t): set by EPX_GROUP_INFO_INIT */
    int rank;
    int world_size;
    int local_rank;
    int ranks_per_node;
    epx_backend_t backend; /* resolved, never AUTO */
    int device;            /* -1 for the host backend */
} epx_group_info_t;

#define EPX_GROUP_INFO_INIT {sizeof(epx_group_info_t), 0, 0, 0, 0, EPX_BACKEND_AUTO, -1}

/* Local. `info` must be initialised with EPX_GROUP_INFO_INIT. */
epx_status_t epx_group_get_info(epx_group_t group, epx_group_info_t *info);
/*
 * Collective barrier with the group's timeout (outside any buffer operation). With the
 * TCP rendezvous rank 0 releases the others one after another, a few microseconds a rank
 * apart; so rank 0 names a common time at which the ranks on its host leave, at most
 * EPX_BARRIER_ALIGN_US (default 200, read on rank 0) after the last rank arrived, from
 * the group's second barrier on: 8 ranks on an H200 host leave within 0.2 us (median)
 * instead of 32-35 us apart (docs/PERFORMANCE.md); ranks on other hosts leave at once;
 * 0 turns it off. With caller callbacks, whatever the caller's barrier gives.
 */
epx_status_t epx_group_barrier(epx_group_t group);
/*
 * Collective allgather over the group's rendezvous, with the group's timeout (outside any
 * buffer operation; for small control data such as a benchmark's timings, not the data
 * path). Every rank contributes `bytes` (> 0, the same on every rank) at `send`; `recv`
 * receives world_size * bytes, rank i's contribution at offset i * bytes. A rank whose
 * arguments are refused returns at once; its peers then wait until the timeout.
 */
epx_status_t epx_group_allgather(epx_group_t group, const void *send, void *recv, size_t bytes);

/* ---------------------------------------------------------------- buffers */

typedef struct {
    size_t size;                  /* sizeof(epx_buffer_config_t) */
    int64_t max_tokens_per_rank;  /* most input tokens any rank passes to one call */
    int64_t hidden;               /* elements per token row */
    int num_experts;              /* global count, multiple of world size */
    int num_topk;                 /* experts per token, 1..num_experts */
    epx_dtype_t dispatch_dtype;   /* BF16 (default) or FP8_E4M3 (+ fp32 scales) */
    int num_sms;                  /* SMs per rank for GPU kernels; 0 = EPX_NUM_SMS */
    /* Low-latency mode (epx_ll_*): most tokens any rank passes to one low-latency call,
     * 0..65536. 0 (default) = low-latency mode off and no memory reserved for it. */
    int64_t max_low_latency_tokens;
    /* Low-latency dispatch rows: BF16 (default; 0 means BF16) sizes them for bf16, so both
     * bf16 and fp8 calls work; FP8_E4M3 sizes them for fp8 (about half the low-latency
     * memory) and epx_ll_dispatch then refuses use_fp8 = 0. */
    epx_dtype_t low_latency_dtype;
    /* Normal-mode combine from an x outside the buffer and outside epx_buffer_register's
     * ranges: 1 = map x's allocation for the peers the first time it is seen and read it
     * in place from then on, as if registered (the CUDA backend; "Combine inputs mapped on
     * demand" in docs/DESIGN.md); -1 = copy x into the buffer first; 0 (default) =
     * EPX_AUTO_REGISTER (1 or 0; unset: copy). Every rank must resolve to the same. With
     * it on, each combine exchanges a few bytes between the ranks' hosts. */
    int auto_register;
} epx_buffer_config_t;

/* Earlier sizes accepted: offsetof(epx_buffer_config_t, max_low_latency_tokens),
 * offsetof(epx_buffer_config_t, low_latency_dtype) and offsetof(epx_buffer_config_t,
 * auto_register) (epx before low-latency mode, before low_latency_dtype and before
 * auto_register); the fields past them take their defaults. */
#define EPX_BUFFER_CONFIG_INIT \
    {sizeof(epx_buffer_config_t), 0, 0, 0, 0, EPX_DTYPE_BF16, 0, 0, EPX_DTYPE_BF16, 0}

/* Bytes of communication memory one rank allocates for this config (no allocation). */
epx_status_t epx_buffer_size(epx_group_t group, const epx_buffer_config_t *config,
                             size_t *bytes_per_rank);
/* Collective: allocate and map the buffer on every rank. */
epx_status_t epx_buffer_create(epx_group_t group, const epx_buffer_config_t *config,
                               epx_buffer_t *buffer);
/*
 * Collective while the buffer is healthy on this rank, on both backends: the rank waits
 * for its queued work, then every rank votes (within the group's timeout) that it is
 * done, so no rank frees memory a peer may still read; every rank destroys its buffers
 * in the same order. Returns the vote's status: EPX_SUCCESS, or EPX_ERR_TIMEOUT /
 * EPX_ERR_REMOTE when a peer did not take part. A buffer that failed on this rank (any
 * call returned its first error) is destroyed locally, without a vote, and returns
 * EPX_SUCCESS. The buffer is freed in every case; do not use it afterwards.
 */
epx_status_t epx_buffer_destroy(epx_buffer_t buffer);

/*
 * Local: fail the buffer on this rank as a failed collective operation would, with
 * `status` (an error of epx_status_t, not EPX_SUCCESS) and `message` (may be NULL): the
 * peers' waits in the current or next operation end with EPX_ERR_REMOTE naming this
 * rank, and every later call on this buffer returns `status`. For a caller that finds an
 * error itself before entering a collective operation (a language binding's argument
 * checks), so the peers do not wait until the timeout. Returns EPX_SUCCESS when done.
 */
epx_status_t epx_buffer_abort(epx_buffer_t buffer, epx_status_t status, const char *message);

/*
 * The first asynchronous failure seen by the buffer's operations (device-side timeout,
 * a peer that failed), EPX_SUCCESS if none. `message` (may be NULL) receives text that
 * names the rank and the stage. A low-latency wait on the GPU that gave up on a peer is
 * reported here too (the peer is then masked, see epx_ll_get_masked); unlike the other
 * failures it leaves the buffer usable.
 */
epx_status_t epx_get_async_error(epx_buffer_t buffer, epx_status_t *error, char *message,
                                 size_t message_size);

/* ---------------------------------------------------------------- layout */

/*
 * Local: count tokens per rank and expert for `topk_idx`. No communication. A bad expert
 * id is EPX_ERR_INVALID_ARG naming topk_idx: returned by this call on the host backend; on
 * a GPU backend the layout kernel finds it (no host wait), so it becomes the buffer's
 * async error once the stream has run, returned by the next call on the buffer, which then
 * fails as after a dispatch given a bad id.
 */
typedef struct {
    size_t size;
    epx_tensor_t topk_idx;              /* in  [tokens, num_topk] int64, -1 = none */
    epx_tensor_t num_tokens_per_rank;   /* out [world_size] int32 */
    epx_tensor_t num_tokens_per_expert; /* out [num_experts] int32 */
    epx_tensor_t is_token_in_rank;      /* out [tokens, world_size] bool (optional) */
} epx_layout_args_t;

#define EPX_LAYOUT_ARGS_INIT \
    {sizeof(epx_layout_args_t), EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE}

epx_status_t epx_get_dispatch_layout(epx_buffer_t buffer, const epx_layout_args_t *args,
                                     void *stream);

/* ---------------------------------------------------------------- normal mode */

/* Dispatch flags. */
#define EPX_DISPATCH_WORST_CASE 0x1u /* no host sync: outputs sized for the worst case */

typedef struct {
    size_t size;
    epx_tensor_t x;            /* [tokens, hidden] bf16, or fp8 e4m3 */
    epx_tensor_t x_scales;     /* [tokens, hidden/128] fp32 when x is fp8; row or column major */
    /* [tokens, num_topk] int64, -1 = none; an expert named twice in a token's row counts
     * once (the token goes to it once; recv_topk_idx keeps both entries). Ignored in
     * cached mode (may be given; the routing comes from the handle). */
    epx_tensor_t topk_idx;
    /* [tokens, num_topk] fp32, optional; ignored in cached mode (no recv_topk_weights). */
    epx_tensor_t topk_weights;
    epx_handle_t handle;       /* non-NULL: cached mode, reuse this routing */
    int expert_alignment;      /* per-expert counts rounded up to this; 0 or 1 = none */
    uint32_t flags;            /* EPX_DISPATCH_* */
    /*
     * Optional outputs, all or none: with recv_x given, every other output this dispatch
     * produces must be given too (recv_x_scales for fp8 x, recv_topk_idx and
     * recv_topk_weights when topk_idx / topk_weights are given in fresh mode), and none
     * it does not produce; without recv_x, none. Otherwise EPX_ERR_INVALID_ARG (a form
     * error: see the conventions at the top). data == NULL: the result is a view into the
     * buffer, valid until this rank's next operation on the buffer. Given: rows >=
     * received tokens (or the worst case, max_tokens_per_rank * world_size, with
     * EPX_DISPATCH_WORST_CASE).
     */
    epx_tensor_t recv_x;            /* [rows, hidden] same dtype as x */
    epx_tensor_t recv_x_scales;     /* [rows, hidden/128] fp32 */
    epx_tensor_t recv_topk_idx;     /* [rows, num_topk] int64, local expert ids or -1 */
    epx_tensor_t recv_topk_weights; /* [rows, num_topk] fp32, 0 where idx is -1 */
    /*
     * Routing by the layout instead of by topk_idx (DeepEP's dispatch without top-k):
     * in fresh mode without topk_idx, is_token_in_rank [tokens, world_size] bool (nonzero
     * = send) names the ranks that receive each token, and num_tokens_per_expert
     * [num_experts] int32 is this rank's count of tokens per expert, from which the
     * receivers' num_recv_tokens_per_expert are summed; both as epx_get_dispatch_layout
     * writes them. Give both or neither; never with topk_idx or a handle. Such a dispatch
     * has no recv_topk_idx or recv_topk_weights (topk_weights needs topk_idx). Its handle
     * works for combine and cached mode like any other, on one node as across nodes.
     * (Appended in epx 0.1: args of the older size, offsetof(epx_dispatch_args_t,
     * is_token_in_rank), are accepted.)
     */
    epx_tensor_t is_token_in_rank;
    epx_tensor_t num_tokens_per_expert;
} epx_dispatch_args_t;

#define EPX_DISPATCH_ARGS_INIT                                                            \
    {sizeof(epx_dispatch_args_t), EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE,      \
     EPX_TENSOR_NONE, NULL, 0, 0u, EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE,     \
     EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE}

typedef struct {
    size_t size;
    int64_t num_recv_tokens; /* rows received (the valid prefix of the outputs) */
    epx_tensor_t recv_x;
    epx_tensor_t recv_x_scales;     /* data NULL when x was bf16 */
    epx_tensor_t recv_topk_idx;     /* data NULL when no topk_idx/handle routing given */
    epx_tensor_t recv_topk_weights; /* data NULL when topk_weights not given */
    /* [num_local_experts] int32 tokens per local expert, rounded up to the alignment.
     * Host memory owned by the handle (valid until the handle is destroyed). */
    const int32_t *num_recv_tokens_per_expert;
    int num_local_experts;
    /* Device copies (CUDA backend; NULL on the host backend), valid in stream order:
     * an int32 scalar with the rows received and [num_local_experts] int32 counts.
     * With EPX_DISPATCH_WORST_CASE the CUDA backend does not wait for the counts on the
     * host: num_recv_tokens is then -1, num_recv_tokens_per_expert NULL, and these
     * device values are the only counts. */
    const int32_t *num_recv_tokens_device;
    const int32_t *num_recv_tokens_per_expert_device;
    /* The routing of this call. New handle in fresh mode (the caller destroys it);
     * the given handle in cached mode. */
    epx_handle_t handle;
} epx_dispatch_result_t;

#define EPX_DISPATCH_RESULT_INIT                                                             \
    {sizeof(epx_dispatch_result_t), 0, EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE,    \
     EPX_TENSOR_NONE, NULL, 0, NULL, NULL, NULL}

/*
 * Collective. Rank r receives every token of every rank that has at least one expert
 * on r, once, ordered by source rank then source token index.
 */
epx_status_t epx_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                          epx_dispatch_result_t *result, void *stream);

typedef struct {
    size_t size;
    epx_handle_t handle;           /* from the dispatch whose route is reversed */
    epx_tensor_t x;                /* [num_recv_tokens, hidden] bf16, rows in recv order */
    epx_tensor_t topk_weights;     /* [num_recv_tokens, num_topk] fp32, optional */
    epx_tensor_t out_x;            /* [tokens, hidden] bf16, tokens = dispatch's input */
    epx_tensor_t out_topk_weights; /* [tokens, num_topk] fp32, needed iff topk_weights */
    /*
     * DeepEP's bias: up to two [tokens, hidden] bf16 tensors added to out_x, each optional:
     * out_x[t] = bf16(bias[0][t] + bias[1][t] + the rows), in fp32 with the biases added
     * first. (Appended in epx 0.1: args of the older size, offsetof(epx_combine_args_t,
     * bias), are accepted.)
     */
    epx_tensor_t bias[2];
    /*
     * Optional [tokens, num_topk] int64, in the memory dispatch's topk_idx takes (device
     * memory on the CUDA backend): the top-k expert ids of the dispatch (-1: none). When
     * given, each token's rows are summed in the order of DeepEP V2 instead of rank
     * order: a rank's row comes at the place of its last entry in the token's row here
     * (ranks named nowhere in it, after those named, in rank order). Across nodes the same
     * rule orders the ranks inside a node and the nodes' partials (a node at the place of
     * its last entry). The biases still come first; out_topk_weights is summed in the
     * same order. One node only on the CUDA backend (across nodes it is refused,
     * EPX_ERR_UNSUPPORTED). (Appended in epx 0.1: args of the older sizes, up to bias or
     * to this field, are accepted.)
     */
    epx_tensor_t order_topk_idx;
} epx_combine_args_t;

#define EPX_COMBINE_ARGS_INIT                                                              \
    {sizeof(epx_combine_args_t), NULL, EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE,  \
     EPX_TENSOR_NONE, {EPX_TENSOR_NONE, EPX_TENSOR_NONE}, EPX_TENSOR_NONE}

/*
 * Zero-copy combine input. Fills `x` with a bf16 [rows, hidden] view of memory inside the
 * buffer, rows = the handle's num_recv_tokens (max_tokens_per_rank * world_size when the
 * host does not know the count: worst-case mode on the CUDA backend). Write the expert
 * outputs for `handle` there (row i = received row i) and pass this view as combine's x:
 * the peers then read it where it is, with no copy into the buffer first, which is
 * combine's fast path. The memory is this rank's until its next epx_combine returns, and
 * may be written again after the next dispatch on the buffer. Local: not collective.
 */
epx_status_t epx_get_combine_input(epx_buffer_t buffer, epx_handle_t handle, epx_tensor_t *x);

/* Ranges one buffer may have registered at a time (epx_buffer_register). */
#define EPX_MAX_REGISTERED 8

/*
 * Collective: let combine read x in place from memory outside the buffer. Each rank
 * passes its own range [ptr, ptr + bytes) of device memory (its address and size may
 * differ from the other ranks'); afterwards a combine whose x lies inside this rank's
 * range is read by the peers where it is, with no copy into the buffer first (combine
 * from a tensor that is not epx_get_combine_input's view otherwise copies it). Meant
 * for the tensor an engine writes its expert outputs into, allocated once and reused.
 * The range must be one cudaMalloc allocation or part of one (PyTorch's caching
 * allocator without expandable segments qualifies; cudaMallocAsync and VMM memory have
 * no CUDA IPC handle and are refused naming the CUDA error). Make that allocation's size a
 * multiple of 2 MiB (PyTorch's allocator does): measured on an H200, peers read other
 * sizes 1.3-1.7x slower, so registering one logs a warning. The range stays the caller's and
 * must stay allocated until epx_buffer_deregister or epx_buffer_destroy returns on every
 * rank. Ranges of one rank may not overlap each other or the buffer; at most
 * EPX_MAX_REGISTERED at once. On the CPU backend the range is checked and recorded, and
 * combine copies as before. Every rank returns the same kind of answer (a refusal on
 * one rank is EPX_ERR_REMOTE naming it on the others); normal mode, CUDA IPC peers (on
 * several nodes, the ranks of this node) only.
 */
epx_status_t epx_buffer_register(epx_buffer_t buffer, void *ptr, size_t bytes);
/*
 * Collective: forget the range registered at `ptr` on this rank (its exact start).
 * Waits for this rank's queued work first, and every rank votes, so when it returns no
 * peer reads the range any more and the caller may free it.
 */
epx_status_t epx_buffer_deregister(epx_buffer_t buffer, void *ptr);

/*
 * Collective. out_x[t] = sum over the ranks r that received token t of x_r[row of t]
 * (fp32 accumulation in rank order, after the biases if given; bf16 out); tokens sent
 * nowhere get zeros (plus their biases). When the group spans nodes (ranks_per_node
 * below the world size) the rows are summed inside each node first, each node's sum is
 * rounded to bf16, and those are summed in node order after the biases
 * (docs/INTERNODE.md); out_topk_weights likewise, without the rounding.
 */
epx_status_t epx_combine(epx_buffer_t buffer, const epx_combine_args_t *args, void *stream);

/* ---------------------------------------------------------------- handles */

typedef struct {
    size_t size;             /* sizeof(epx_handle_info_t): set by EPX_HANDLE_INFO_INIT */
    int64_t num_tokens;      /* tokens this rank passed to dispatch */
    int64_t num_recv_tokens; /* tokens this rank received */
    int num_local_experts;
    int expert_alignment;
} epx_handle_info_t;

#define EPX_HANDLE_INFO_INIT {sizeof(epx_handle_info_t), 0, 0, 0, 0}

/* Local. `info` must be initialised with EPX_HANDLE_INFO_INIT. */
epx_status_t epx_handle_get_info(epx_handle_t handle, epx_handle_info_t *info);
/*
 * DeepEP's rank_prefix_matrix of the dispatch that made `handle`: `matrix` receives an
 * int32 [world_size, world_size] view, [s][r] = tokens that ranks 0..s sent to rank r (so
 * rank r's rows from source s are rows [s][r] - count .. [s][r] - 1, and [world-1][r] is
 * what r received). Memory owned by the handle, valid until it is destroyed: host memory
 * on the host backend, device memory on the CUDA backend (written in stream order by the
 * dispatch, so also in worst-case mode, where the host does not know the counts), on one
 * node as across nodes.
 */
epx_status_t epx_handle_get_rank_prefix_matrix(epx_handle_t handle, epx_tensor_t *matrix);
epx_status_t epx_handle_destroy(epx_handle_t handle);

/* ================================================================ low-latency mode
 *
 * Decode-time dispatch and combine (docs/DESIGN.md, docs/LOW_LATENCY.md), shaped
 * after DeepEP's low_latency_dispatch / low_latency_combine. Needs a buffer created
 * with config.max_low_latency_tokens > 0 (M below); R = world size, L = num_experts / R
 * local experts, k = num_topk. No host synchronisation on the GPU backend, so the
 * calls can be captured in a CUDA graph.
 *
 * Steps and slots. A dispatch and the combines that use its handle form a step. The
 * buffer has two slots, and consecutive dispatches alternate between them, so step
 * n's combine may run after step n+1's dispatch (overlap). A dispatch reuses the slot
 * of the dispatch two before it, which invalidates that step's handle and views.
 *
 * Send/receive split. With EPX_LL_SEND_ONLY a dispatch or combine only issues its
 * sends and returns; epx_ll_receive(handle) later waits for the data and finishes the
 * operation (result tensors are valid only after it), so compute runs in between and
 * nothing spins meanwhile. At most two operations may be sent and not yet received
 * (one per slot).
 *
 * Misuse is refused with EPX_ERR_INVALID_STATE and has no effect: a dispatch whose slot
 * still has an operation waiting for its receive (a third operation in flight), a
 * receive on a handle with nothing pending, a combine before its dispatch was received
 * or while a combine of the same step is pending, and any use of a handle whose slot a
 * later dispatch reused. Argument errors (EPX_ERR_INVALID_ARG / EPX_ERR_CAPACITY) are
 * found before anything is sent and have no effect either; unlike normal mode they do
 * not poison the buffer (the peers' call then ends in a timeout naming this rank). One
 * exception on a GPU backend: topk_idx lives in device memory and the host never reads
 * it, so an expert id out of range (not -1, not 0..num_experts-1) is found by the
 * kernels, which treat that entry as -1 (no row sent, nothing combined for it) and
 * complete the step; epx_get_async_error then returns EPX_ERR_INVALID_ARG naming the
 * first such entry, and the buffer stays usable.
 *
 * Failed peers. A low-latency wait that a peer does not answer within the group's
 * timeout, or whose process exited or published a failure, masks that rank on this rank
 * (as epx_ll_mask_rank) and completes the step with the other ranks: the results are
 * written, the handle is valid and the step goes on (combine, receive) as if nothing had
 * happened, so all survivors stay in step whichever of their calls saw the loss. The
 * loss is reported, naming the rank and stage, by epx_get_async_error (it does not
 * poison the buffer) and, where the wait runs on the host (CPU backend), as the call's
 * own return value EPX_ERR_TIMEOUT or EPX_ERR_REMOTE, the one case where a call that
 * returns an error has written its results. On the GPU the call returned before the
 * wait, so the async error is the only report. A masked rank is left out of later
 * calls: nothing is sent to it or awaited from it, its rows are absent from dispatch
 * results, and its experts' rows come back to combine as zeros; the entries so affected
 * are counted in the results.
 */

/* Flags of epx_ll_dispatch and epx_ll_combine. */
#define EPX_LL_SEND_ONLY 0x1u /* issue the sends only; epx_ll_receive completes the op */

/*
 * The identity of one low-latency step: a value (copy it freely, nothing to destroy).
 * It names a slot and the dispatch that filled it, so a stale handle is detected and
 * refused, never dereferenced. All zeros (EPX_LL_HANDLE_NONE) is never valid.
 */
typedef struct {
    uint64_t internal[4];
} epx_ll_handle_t;

#define EPX_LL_HANDLE_NONE {{0, 0, 0, 0}}

typedef struct {
    size_t size;
    epx_tensor_t x;        /* [tokens, hidden] bf16, tokens <= M (0 allowed) */
    epx_tensor_t topk_idx; /* [tokens, k] int64 global expert ids, -1 = skipped */
    /* Cast to fp8 e4m3 during dispatch, with one scale per 128 channels of a token:
     * scale = max(amax, 1e-4) / 448 (fp32), value = e4m3_rn_satfinite(x * (448 / amax')).
     * hidden must be a multiple of 128. */
    int use_fp8;
    /* fp8: round each scale up to a power of two, scale = 2^ceil(log2(amax' / 448)),
     * value = e4m3(x * 2^-e). */
    int round_scale;
    /* fp8 + round_scale: return the scales as UE8M0 exponent bytes (e + 127), four per
     * int32 (channel group g in byte g % 4 of word g / 4). hidden % 512 == 0. */
    int use_ue8m0;
    uint32_t flags; /* EPX_LL_SEND_ONLY */
    /* Optional [L] int32 (DeepEP's cumulative_local_expert_recv_stats): the receive adds
     * recv_count to it (in stream order on the GPU), so it counts rows per local expert
     * across calls. (Appended in epx 0.1: args of the older size,
     * offsetof(epx_ll_dispatch_args_t, cumulative_local_expert_recv_stats), are accepted.) */
    epx_tensor_t cumulative_local_expert_recv_stats;
    /* Optional [R] int64, contiguous (DeepEP's dispatch_wait_recv_cost_stats): for each
     * source rank s, the receive adds to entry s the nanoseconds from the start of the
     * receive (for a call without EPX_LL_SEND_ONLY: of the call, whose send and receive
     * are one) until s's data (its counts and rows) had arrived, timed with the GPU's
     * global timer (CPU backend: CLOCK_MONOTONIC), in stream order; so a slow rank stands
     * out as the largest entry on the others (on the GPU a dispatch's send waits for the
     * lower ranks' counts, so a late rank also delays the ranks above it: see "Wait
     * times" in docs/LOW_LATENCY.md). Masked ranks, and a rank whose wait fails,
     * add nothing. Nanoseconds, where DeepEP counts SM clock cycles (and adds once per
     * local expert and source; docs/LOW_LATENCY.md). GPU: kernels 2 only (the default);
     * a buffer on kernels 1 refuses it with EPX_ERR_UNSUPPORTED, before anything is sent.
     * (Appended in epx 0.1: args of the older sizes, offsetof(epx_ll_dispatch_args_t,
     * wait_recv_cost_stats) and the one before, are accepted.) */
    epx_tensor_t wait_recv_cost_stats;
} epx_ll_dispatch_args_t;

#define EPX_LL_DISPATCH_ARGS_INIT                                                         \
    {sizeof(epx_ll_dispatch_args_t), EPX_TENSOR_NONE, EPX_TENSOR_NONE, 0, 0, 0, 0u,      \
     EPX_TENSOR_NONE, EPX_TENSOR_NONE}

/*
 * Dispatch results: views into the buffer's slot, valid until the slot is reused (two
 * dispatches later). With EPX_LL_SEND_ONLY their contents are valid after epx_ll_receive.
 * Within each local expert, rows are ordered by source rank, then source token index
 * (deterministic; the GPU backend keeps this order, see docs/LOW_LATENCY.md). A token
 * that names the same expert twice sends one row for it.
 */
typedef struct {
    size_t size;
    /* [L, M * R, hidden] bf16, or fp8 e4m3 with use_fp8; rows >= recv_count[e] unused. */
    epx_tensor_t recv_x;
    /* fp8 only: [L, M * R, hidden / 128] fp32, or [L, M * R, hidden / 512] int32 (ue8m0). */
    epx_tensor_t recv_x_scales;
    /* [L] int32: valid rows per local expert. */
    epx_tensor_t recv_count;
    /* [L, M * R] int32: source token index (on its source rank) of each row. */
    epx_tensor_t recv_src_info;
    /* [L, R] int64: rows of local expert e from source rank s are rows begin..begin+count-1,
     * packed as (begin << 32) | count (DeepEP's layout_range). */
    epx_tensor_t recv_layout_range;
    /* (token, expert) entries of this rank's input not sent because the expert's rank is
     * masked (their combine rows come back as zeros); -1 where the backend cannot count
     * without a host sync (GPU: see epx_ll_get_masked). */
    int64_t num_masked_entries;
    epx_ll_handle_t handle;
} epx_ll_dispatch_result_t;

#define EPX_LL_DISPATCH_RESULT_INIT                                                        \
    {sizeof(epx_ll_dispatch_result_t), EPX_TENSOR_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE,  \
     EPX_TENSOR_NONE, EPX_TENSOR_NONE, 0, EPX_LL_HANDLE_NONE}

/* Collective: every rank that is not masked calls it. */
epx_status_t epx_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                             epx_ll_dispatch_result_t *result, void *stream);

/*
 * Finish the operation that `handle`'s step sent with EPX_LL_SEND_ONLY (a dispatch, or
 * a combine): wait for the peers' data and write the results. DeepEP's receive hook.
 */
epx_status_t epx_ll_receive(epx_buffer_t buffer, epx_ll_handle_t handle, void *stream);

typedef struct {
    size_t size;
    epx_ll_handle_t handle;    /* from the dispatch of this step (received) */
    /* [L, M * R, hidden] bf16 expert outputs, row i of expert e = recv row i; contiguous.
     * May be the zero-copy view of epx_ll_get_combine_buffer. */
    epx_tensor_t x;
    epx_tensor_t topk_idx;     /* [tokens, k] int64, as given to this step's dispatch */
    epx_tensor_t topk_weights; /* [tokens, k] fp32 */
    epx_tensor_t out;          /* [tokens, hidden] bf16, written (by the receive) */
    uint32_t flags;            /* EPX_LL_SEND_ONLY */
    /* Optional [R] int64, contiguous (DeepEP's combine_wait_recv_cost_stats): for each
     * expert rank s, the receive adds to entry s the nanoseconds from the start of the
     * receive (or call) until s's expert outputs had arrived; clocks, masked ranks, units
     * and kernels as in epx_ll_dispatch_args_t.wait_recv_cost_stats. (Appended in epx 0.1:
     * args of the older size, offsetof(epx_ll_combine_args_t, wait_recv_cost_stats), are
     * accepted.) */
    epx_tensor_t wait_recv_cost_stats;
} epx_ll_combine_args_t;

#define EPX_LL_COMBINE_ARGS_INIT                                                           \
    {sizeof(epx_ll_combine_args_t), EPX_LL_HANDLE_NONE, EPX_TENSOR_NONE, EPX_TENSOR_NONE,  \
     EPX_TENSOR_NONE, EPX_TENSOR_NONE, 0u, EPX_TENSOR_NONE}

typedef struct {
    size_t size;
    /* Top-k entries whose expert's rank is masked, so they added zero; -1 where the
     * backend cannot count without a host sync (GPU). With EPX_LL_SEND_ONLY the combine
     * writes -1 and keeps a pointer to this struct, and epx_ll_receive writes the final
     * count into it: the struct must stay valid until that receive. */
    int64_t num_masked_entries;
} epx_ll_combine_result_t;

#define EPX_LL_COMBINE_RESULT_INIT {sizeof(epx_ll_combine_result_t), 0}

/*
 * Collective. out[t] = bf16(sum over j with topk_idx[t][j] >= 0 of
 * topk_weights[t][j] * x_expert[row of (t, expert)]), in fp32 and j order, each entry added
 * with one fused multiply-add (acc = fmaf(w, x, acc): one rounding, as DeepEP's combine
 * compiles to); a token with no expert (or only masked ones) gets zeros. `result` may be NULL. May be
 * called again with the same handle (e.g. benchmarks); each call is collective.
 */
epx_status_t epx_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                            epx_ll_combine_result_t *result, void *stream);

/*
 * Zero-copy combine input: `x` receives a contiguous bf16 [L, M * R, hidden] view of the
 * slot memory that combine sends from. Write the expert outputs there and pass the view
 * as combine's x. Valid while the handle is. Local. (DeepEP's
 * get_next_low_latency_combine_buffer.)
 */
epx_status_t epx_ll_get_combine_buffer(epx_buffer_t buffer, epx_ll_handle_t handle,
                                       epx_tensor_t *x);

/*
 * Local: leave `rank` out of this rank's later low-latency calls (a failed peer). Every
 * surviving rank must mask the same ranks before the same call (a wait that fails on a
 * peer masks it by itself). A rank cannot mask itself. Only a rejoin (epx_ll_rejoin)
 * undoes a mask.
 */
epx_status_t epx_ll_mask_rank(epx_buffer_t buffer, int rank);

/* Local: mask[r] = 1 if rank r is masked on this rank, else 0; `count` >= world size. */
epx_status_t epx_ll_get_masked(epx_buffer_t buffer, int32_t *mask, int count);

/*
 * Local: forget both slots (every handle becomes invalid). EPX_ERR_INVALID_STATE while
 * an operation is sent and not received. Unlike DeepEP's clean_low_latency_buffer no
 * memory needs zeroing: arrival flags carry sequence numbers.
 */
epx_status_t epx_ll_clean_buffer(epx_buffer_t buffer, void *stream);

/*
 * Rejoin (docs/STABILITY.md). A rank lost in low-latency serving, and masked on every
 * survivor, is replaced by a new process with the same rank number, which joins the
 * survivors' running buffer; the survivors keep their buffers. First every rank, the
 * newcomers included, forms a new group from a fresh rendezvous (a unique id that a
 * survivor makes and the serving system hands to the newcomer, or callbacks), with the
 * same world size and rank numbers: the old group cannot take a new process in, and may
 * have lost its rendezvous hub. Then, between steps (no low-latency operation sent and
 * not received on any survivor), every survivor calls epx_ll_rejoin and every newcomer
 * epx_buffer_create_rejoin on that group. Several lost ranks come back in one rejoin:
 * the new group holds every rank, so the newcomers must be exactly the ranks the
 * survivors masked. Every wait ends within the new group's timeout.
 *
 * On success, on every rank: the newcomers are unmasked and the next dispatch includes
 * every rank; low-latency handles from before are stale (as after epx_ll_clean_buffer);
 * the buffer belongs to the new group (destroy it before that group; it no longer uses
 * the old one); epx_get_async_error no longer reports the loss; and the buffer serves
 * low-latency mode only: epx_dispatch, epx_combine and epx_get_combine_input return
 * EPX_ERR_INVALID_STATE, with no effect (a newcomer has no normal-mode memory; make a new
 * buffer for normal mode).
 *
 * On failure every rank returns an error, EPX_ERR_REMOTE naming the rank on the ranks
 * whose own arguments were fine, and a survivor's buffer is as it was: serving, the rank
 * still masked; nothing is left in /dev/shm. Try again with a new group. Refused on
 * every rank alike (a rank with a bad argument still takes part, so that the others
 * learn why): a newcomer that some survivor has not masked (its loss not seen there
 * yet) and a masked rank that does not come back (EPX_ERR_INVALID_STATE); an operation
 * in flight on a survivor (EPX_ERR_INVALID_STATE); on the CPU backend, a lost rank whose
 * old process still runs (it still maps the survivors' memory: end it first;
 * EPX_ERR_INVALID_STATE); a group in which this process has another rank number or world
 * size than in the buffer, or another backend (EPX_ERR_INVALID_ARG); configs that differ
 * (EPX_ERR_INVALID_ARG); a buffer without low-latency mode (EPX_ERR_INVALID_STATE); a
 * buffer that failed (its first error). Refused at once on the calling rank alone, since
 * it cannot reach the others (theirs then fail within the timeout): a group that is not
 * live, and the buffer's own group (EPX_ERR_INVALID_ARG).
 * The CUDA backend returns EPX_ERR_UNSUPPORTED: its low-latency memory is NVSHMEM's
 * symmetric heap, and NVSHMEM cannot add a PE to a running job.
 */
/* Survivor: collective over `group` with the newcomers' epx_buffer_create_rejoin. */
epx_status_t epx_ll_rejoin(epx_buffer_t buffer, epx_group_t group);
/*
 * Newcomer: collective with the survivors' epx_ll_rejoin. `config` must be the survivors'
 * (max_low_latency_tokens > 0). `*buffer` is written on success only.
 */
epx_status_t epx_buffer_create_rejoin(epx_group_t group, const epx_buffer_config_t *config,
                                      epx_buffer_t *buffer);

#ifdef __cplusplus
}
#endif

#endif /* EPX_H */
