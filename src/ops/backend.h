/*
 * The backend interface: the one header between the API layer (the .c files directly
 * in src/) and the backends (src/ops/host, src/ops/cuda).
 *
 * It holds the objects both sides read (buffers, handles; the group is ops/group.h),
 * the table every backend fills (epx__backend_ops_t: entry points, optional hooks and
 * capability flags, so the API layer asks what a backend can do instead of which
 * backend it is), and the few services a backend may call, defined beside it in
 * src/ops/backend.c. Entry points validate arguments, then call the backend through the
 * table; backends may rely on arguments being checked. Nothing here calls up into the
 * API layer.
 */
#ifndef EPX_OPS_BACKEND_H
#define EPX_OPS_BACKEND_H

#include <stdatomic.h>
#include <stdint.h>

#include "core/core.h"
#include "core/constants.h"
#include "core/tensor.h"
#include "epx.h"
#include "epx_tool.h"
#include "ops/group.h"

typedef struct epx__backend_ops epx__backend_ops_t;

/*
 * Low-latency steps (src/epx_ll.c keeps this; backends see only slot numbers). A slot
 * is free, has a sent operation waiting for its receive, or holds a received dispatch
 * (possibly combined) whose views and handle stay valid until the slot is reused.
 */
typedef enum {
    EPX__LL_FREE = 0,
    EPX__LL_DISPATCH_SENT = 1,
    EPX__LL_DISPATCHED = 2,
    EPX__LL_COMBINE_SENT = 3,
    EPX__LL_COMBINED = 4,
} epx__ll_slot_state_t;

typedef struct {
    epx__ll_slot_state_t state;
    uint64_t generation; /* dispatches made into this slot (handles carry it) */
    int64_t num_tokens;  /* the dispatch's input tokens (combine checks its shapes) */
    /* A combine sent with EPX_LL_SEND_ONLY: the caller's result, which the receive
     * completes with the masked count (NULL when none was given). */
    epx_ll_combine_result_t *combine_result;
} epx__ll_slot_t;

typedef struct {
    epx__ll_slot_t slots[2];
    int next_slot;       /* slot of the next dispatch */
    uint64_t tag;        /* identifies this buffer in its handles */
} epx__ll_state_t;

struct epx_buffer {
    epx_group_t group;
    /* Unique in the process (never reused, unlike the address): handles carry it, so a
     * handle of a destroyed buffer is refused by a new buffer made at the same address. */
    uint64_t serial;
    /* A normal-mode call was refused for its form (src/epx.c): the peers may have failed
     * it, so epx_buffer_destroy skips its vote as they do. */
    int refused;
    epx_buffer_config_t config; /* num_sms resolved, never 0 */
    int num_local_experts;      /* num_experts / world_size */
    const epx__backend_ops_t *ops;
    void *impl; /* backend state */
    /* First failure of a collective operation; later calls return it. */
    _Atomic int async_error;
    char async_message[512];
    epx__ll_state_t ll; /* low-latency mode (config.max_low_latency_tokens > 0) */
    /* A low-latency peer failure seen asynchronously (GPU): the peer is masked and the
     * buffer stays usable; epx_get_async_error reports it when nothing worse happened. */
    _Atomic int ll_peer_error;
    char ll_peer_message[512];
    /* Set by a rejoin (src/epx_ll_rejoin.c) on every rank: the buffer serves low-latency
     * mode only; normal-mode calls are refused (the rank that rejoined has no normal-mode
     * memory). `rejoined` names the last rank that rejoined, for the message. */
    int low_latency_only;
    int rejoined;
    /* epx_buffer_register's ranges of this rank, by slot (bytes 0: free); the slot is
     * the same on every rank (collective calls in the same order, checked by a vote). */
    struct {
        char *ptr;
        size_t bytes;
    } registered[EPX_MAX_REGISTERED];
};

/*
 * The routing of one dispatch, on host memory (every backend keeps this copy; a GPU
 * backend adds its device copies in backend_state).
 */
struct epx_handle {
    epx_buffer_t buffer;    /* handles only work with the buffer that made them */
    uint64_t buffer_serial; /* that buffer's serial */
    int world_size;
    int rank;
    int num_local_experts;
    int expert_alignment;
    int64_t num_tokens;       /* tokens this rank sent (dispatch input rows) */
    int64_t num_recv_tokens;  /* rows this rank received */
    /* [num_tokens * world_size]: row of token t at rank r, or -1 if t was not sent to r. */
    int32_t *send_row;
    /* [world_size * world_size]: tokens rank s sent to rank r at [s * world_size + r]. */
    int32_t *rank_counts;
    /* [num_recv_tokens]: source rank and source token index of each received row. */
    int32_t *recv_src_rank;
    int32_t *recv_src_token;
    /* [num_local_experts]: rows per local expert, rounded up to expert_alignment. */
    int32_t *num_recv_per_expert;
    /* [world_size * world_size] rank_prefix_matrix (epx_handle_get_rank_prefix_matrix):
     * a GPU backend's device copy (in backend_state, or NULL), else a host copy made from
     * rank_counts on first request (NULL until then). */
    const int32_t *rank_prefix_device;
    int32_t *rank_prefix;
    void *backend_state;
    void (*backend_free)(struct epx_handle *handle);
};

struct epx__backend_ops {
    const char *name;
    unsigned caps; /* EPX__BACKEND_* */

    /* ---- groups (optional) */
    /* Devices this backend can use (EPX_BACKEND_AUTO picks the backend that has some). */
    int (*device_count)(void);
    /* The group is being destroyed, after its buffers (collective where the backend set
     * up something process-wide through this group, such as NVSHMEM). */
    void (*group_destroy)(epx_group_t group);

    /* ---- buffers */
    /* Bytes one rank allocates for this config. */
    epx_status_t (*buffer_size)(epx_group_t group, const epx_buffer_config_t *config,
                                size_t *bytes);
    /* Optional (NULL = none): epx_internode_plan's answer for this config on a group of
     * this shape (spanning nodes), all but bytes_per_rank, which the caller fills in. */
    epx_status_t (*internode_plan)(epx_group_t group, const epx_buffer_config_t *config,
                                   epx_internode_plan_t *plan);
    /* Collective: fill buffer->impl. The generic fields of `buffer` are set. */
    epx_status_t (*buffer_create)(epx_buffer_t buffer);
    /*
     * Optional (NULL = always ready): before epx_buffer_destroy's vote, finish this rank's
     * queued work, record any failure the backend saw (buffer->async_error), and say
     * whether this rank may take part in freeing memory allocated collectively (0 when a
     * peer is masked or lost).
     */
    int (*destroy_ready)(epx_buffer_t buffer);
    /* Free the buffer's state. `all_ready`: every rank voted ready (collective frees are
     * safe); 0 when the vote failed, was skipped, or some rank was not ready. */
    void (*buffer_destroy)(epx_buffer_t buffer, int all_ready);
    /*
     * Tell the peers that this rank failed inside a collective operation (so their
     * waits end with EPX_ERR_REMOTE naming this rank instead of a timeout).
     */
    void (*abort)(epx_buffer_t buffer, epx_status_t status, const char *message);
    /*
     * Optional. This rank refused a normal-mode call for the form of its arguments,
     * before taking any part in it, and stays usable: make the peers' waits in that call
     * end with EPX_ERR_REMOTE (but not those of peers that refused it too). NULL: the
     * entry point treats the error like any other failure (abort and poison).
     */
    void (*refuse)(epx_buffer_t buffer, const char *message);
    epx_status_t (*layout)(epx_buffer_t buffer, const epx_layout_args_t *args, void *stream);
    epx_status_t (*dispatch)(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                             epx_dispatch_result_t *result, void *stream);
    epx_status_t (*combine)(epx_buffer_t buffer, const epx_combine_args_t *args,
                            void *stream);
    /*
     * The combine-input region of this rank (see epx_get_combine_input): its base, with
     * room for `*rows` bf16 rows of `hidden` (max_tokens_per_rank * world_size). Combine
     * must read an x that starts at this base in place.
     */
    epx_status_t (*combine_input)(epx_buffer_t buffer, void **base, int64_t *rows);
    /*
     * Optional (NULL: the range is only recorded; combine copies). Collective, after the
     * API layer's checks and vote (buffer->registered[slot] is already filled on every
     * rank): map every peer's range of `slot` so combine reads an x inside it in place.
     * Every rank returns the same kind of answer. `unregister` undoes it (collective;
     * the range is still in buffer->registered).
     */
    epx_status_t (*register_range)(epx_buffer_t buffer, int slot);
    epx_status_t (*unregister_range)(epx_buffer_t buffer, int slot);
    /*
     * Optional (NULL = nothing to poll): record in buffer->async_error a failure the
     * backend learned asynchronously, such as a device-side timeout inside a kernel
     * replayed from a CUDA graph. epx_get_async_error calls it before answering.
     */
    void (*poll_async_error)(epx_buffer_t buffer);

    /*
     * Low-latency mode (include/epx.h, docs/LOW_LATENCY.md). Optional: NULL makes the
     * epx_ll_* calls return EPX_ERR_UNSUPPORTED. src/epx_ll.c validates the arguments
     * and keeps the slot states; the backend moves the data of slot `slot`.
     * ll_dispatch issues the sends and fills `result`'s views (not the handle);
     * ll_dispatch_receive waits for the data and writes them. ll_combine issues the
     * sends and keeps what its receive needs; ll_combine_receive writes args->out and
     * the masked count. A wait that fails on a peer returns EPX_ERR_TIMEOUT or
     * EPX_ERR_REMOTE and masks the peer; the backend must then still be ready for the
     * next call (the entry point abandons the step).
     */
    epx_status_t (*ll_dispatch)(epx_buffer_t buffer, int slot, const epx_ll_dispatch_args_t *args,
                                epx_ll_dispatch_result_t *result, void *stream);
    epx_status_t (*ll_dispatch_receive)(epx_buffer_t buffer, int slot, void *stream);
    epx_status_t (*ll_combine)(epx_buffer_t buffer, int slot, const epx_ll_combine_args_t *args,
                               void *stream);
    epx_status_t (*ll_combine_receive)(epx_buffer_t buffer, int slot,
                                       epx_ll_combine_result_t *result, void *stream);
    /* The zero-copy combine input of `slot`: bf16 [L, M * R, hidden], contiguous. */
    epx_status_t (*ll_combine_buffer)(epx_buffer_t buffer, int slot, void **base);
    /* Mask `rank` (already checked: a peer, in range); read the mask ([world] 0/1). */
    epx_status_t (*ll_mask_rank)(epx_buffer_t buffer, int rank);
    void (*ll_get_masked)(epx_buffer_t buffer, int32_t *mask);
    /* Bytes that the rows of the low-latency x (dispatch), x and out (combine) must start
     * on (0 = any): checked with the other arguments, before anything is sent. */
    int ll_row_align;
    /* Optional (NULL: supported): EPX_SUCCESS, or the error (naming `op`) when this
     * buffer cannot fill the receives' wait_recv_cost_stats; checked with the other
     * arguments, before anything is sent. */
    epx_status_t (*ll_check_wait_stats)(epx_buffer_t buffer, const char *op);

    /*
     * Optional (NULL = EPX_ERR_UNSUPPORTED): tool support, epx_fanout_copy
     * (include/epx_tool.h; arguments checked, the group on one node, num_sms resolved).
     */
    epx_status_t (*fanout_copy)(epx_buffer_t buffer, const epx_fanout_args_t *args,
                                void *stream);
    /* Optional (NULL = EPX_ERR_UNSUPPORTED): tool support, epx_fanin_reduce (the same
     * checks and resolutions: dst_pitch and num_sms never 0). */
    epx_status_t (*fanin_reduce)(epx_buffer_t buffer, const epx_fanin_args_t *args,
                                 void *stream);

    /*
     * Rejoin (epx_ll_rejoin, epx_buffer_create_rejoin; src/epx_ll_rejoin.c). Optional.
     * ll_rejoin_check: local, before the ranks agree: EPX_SUCCESS, or why this backend
     * cannot take a rank back (NULL: it can when ll_rejoin is set, else the generic
     * EPX_ERR_UNSUPPORTED). ll_rejoin: collective over `ranks`, the new group (every
     * rank), after every rank agreed on who joins (joiners[r] = 1) and that no operation
     * is in flight. A survivor passes its running buffer; a joiner a new buffer whose
     * generic fields are set and impl NULL, which it fills. On success every joiner is
     * unmasked on every rank and the slots' sequence state is shared; on failure a
     * survivor's buffer is as it was (the joiners still masked), a joiner's impl NULL.
     */
    epx_status_t (*ll_rejoin_check)(epx_group_t group);
    epx_status_t (*ll_rejoin)(epx_buffer_t buffer, const epx__transport_ranks_t *ranks,
                              const unsigned char *joiners);
};

/*
 * epx_fanout_copy's routing (include/epx_tool.h): the average fanout in thousandths, and
 * the number of ranks row `row` goes to, k = floor((row + 1) * F / 1000) -
 * floor(row * F / 1000) (the CUDA kernels compute the same from the same F:
 * epx_fanout_count in device.cuh). epx_fanin_reduce reads row `row` back from as many.
 */
static inline int64_t epx__fanout_milli(double fanout)
{
    return (int64_t)(fanout * 1000.0 + 0.5);
}

static inline int epx__fanout_count(int64_t row, int64_t fanout_milli)
{
    return (int)((row + 1) * fanout_milli / 1000 - row * fanout_milli / 1000);
}

/* The tables (src/ops/host, src/ops/cuda). */
extern const epx__backend_ops_t epx__host_backend;
#ifdef EPX_WITH_CUDA
extern const epx__backend_ops_t epx__cuda_backend;
#endif

/* The table of `backend`; NULL when this build has none (or for EPX_BACKEND_AUTO). */
const epx__backend_ops_t *epx__backend_find(epx_backend_t backend);

/* ---------------------------------------------------------------- capabilities */

/*
 * The backend's tensors are in host memory, so the API layer checks values the caller
 * passed (expert ids in topk_idx) before the call. A backend without it checks them
 * itself where the data lies (the CUDA kernels record a bad id as a device failure).
 */
#define EPX__BACKEND_HOST_TENSORS 0x1u


/* ---------------------------------------------------------------- services (src/ops/backend.c) */

/* Record the first asynchronous failure of a buffer (thread-safe; later ones ignored). */
void epx__buffer_set_async_error(epx_buffer_t buffer, epx_status_t status, const char *message);

/*
 * Allocate a handle with its arrays sized (contents zeroed) and list it as live
 * (src/core/objects.h); NULL on out of memory. epx__handle_free takes it off the list
 * and releases it; epx__handle_release frees one already taken off.
 */
struct epx_handle *epx__handle_alloc(epx_buffer_t buffer, int64_t num_tokens,
                                     int64_t num_recv_tokens);
void epx__handle_free(struct epx_handle *handle);
void epx__handle_release(struct epx_handle *handle);

/*
 * A low-latency dispatch's result views, laid out alike by every backend (M * R rows per
 * local expert): recv_x [L, M*R, hidden] bf16 or fp8, scales (fp8 only: fp32
 * [L, M*R, hidden/128], or UE8M0 int32 [L, M*R, hidden/512]), recv_count [L] int32,
 * src_info [L, M*R] int32, layout ranges [L, R] int64. Sets the tensors only.
 */
void epx__ll_dispatch_views(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args, void *recv_x,
                            void *recv_scales, void *recv_count, void *src_info, void *range,
                            epx_ll_dispatch_result_t *result);

#endif /* EPX_OPS_BACKEND_H */
