/*
 * The library's internal objects and the interface every backend implements.
 * Entry points (src/epx.c) validate arguments, then call the backend through
 * epx__backend_ops_t; backends may rely on arguments being checked.
 */
#ifndef EPX_INTERNAL_H
#define EPX_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "bootstrap/bootstrap.h"
#include "core/core.h"
#include "epx.h"

struct epx_group {
    int rank;
    int world_size;
    int local_rank;
    int ranks_per_node; /* resolved: world_size when the config said 0 */
    epx_backend_t backend; /* resolved, never AUTO */
    int device;            /* -1 for host */
    int64_t timeout_ms;    /* resolved: never 0 */
    epx__bootstrap_t *bootstrap;
};

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
} epx__ll_slot_t;

typedef struct {
    epx__ll_slot_t slots[2];
    int next_slot;       /* slot of the next dispatch */
    uint64_t tag;        /* identifies this buffer in its handles */
} epx__ll_state_t;

struct epx_buffer {
    epx_group_t group;
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
};

/*
 * The routing of one dispatch, on host memory (every backend keeps this copy; a GPU
 * backend adds its device copies in backend_state).
 */
struct epx_handle {
    epx_buffer_t buffer;    /* handles only work with the buffer that made them */
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
    void *backend_state;
    void (*backend_free)(struct epx_handle *handle);
};

/* Allocate a handle with its arrays sized (contents zeroed); NULL on out of memory. */
struct epx_handle *epx__handle_alloc(epx_buffer_t buffer, int64_t num_tokens,
                                     int64_t num_recv_tokens);
void epx__handle_free(struct epx_handle *handle);

struct epx__backend_ops {
    const char *name;
    /* Bytes one rank allocates for this config. */
    epx_status_t (*buffer_size)(epx_group_t group, const epx_buffer_config_t *config,
                                size_t *bytes);
    /* Collective: fill buffer->impl. The generic fields of `buffer` are set. */
    epx_status_t (*buffer_create)(epx_buffer_t buffer);
    void (*buffer_destroy)(epx_buffer_t buffer);
    /*
     * Tell the peers that this rank failed inside a collective operation (so their
     * waits end with EPX_ERR_REMOTE naming this rank instead of a timeout).
     */
    void (*abort)(epx_buffer_t buffer, epx_status_t status, const char *message);
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
    /* Optional: EPX_ERR_UNSUPPORTED when this buffer has no normal mode (a CUDA buffer
     * across nodes); checked before anything is sent, so it poisons nothing. */
    epx_status_t (*normal_available)(epx_buffer_t buffer, const char *op);
    /* Bytes that the rows of the low-latency x (dispatch), x and out (combine) must start
     * on (0 = any): checked with the other arguments, before anything is sent. */
    int ll_row_align;
};

extern const epx__backend_ops_t epx__host_backend;
#ifdef EPX_WITH_CUDA
extern const epx__backend_ops_t epx__cuda_backend;
/* Nonzero when a CUDA device is visible (used by EPX_BACKEND_AUTO). */
int epx__cuda_device_count(void);
/*
 * The group is being destroyed: when it is the one that set NVSHMEM up, finalise NVSHMEM
 * if every rank agrees it is safe (collective then; src/ops/cuda/ll_setup.c).
 */
void epx__cuda_ll_group_destroy(epx_group_t group);
#endif

/*
 * A buffer operation's bookkeeping, shared by the normal and low-latency entry points:
 * refuse to run on a buffer that already failed (a device-side failure counts), and
 * record this rank's failure inside a collective and tell the peers (returns `status`).
 */
epx_status_t epx__buffer_check_usable(epx_buffer_t buffer, const char *op);
epx_status_t epx__buffer_fail(epx_buffer_t buffer, epx_status_t status);

/* Record the first asynchronous failure of a buffer (thread-safe; later ones ignored). */
void epx__buffer_set_async_error(epx_buffer_t buffer, epx_status_t status, const char *message);

/*
 * A low-latency dispatch's result views, laid out alike by every backend (M * R rows per
 * local expert): recv_x [L, M*R, hidden] bf16 or fp8, scales (fp8 only: fp32
 * [L, M*R, hidden/128], or UE8M0 int32 [L, M*R, hidden/512]), recv_count [L] int32,
 * src_info [L, M*R] int32, layout ranges [L, R] int64. Sets the tensors only.
 */
void epx__ll_dispatch_views(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args, void *recv_x,
                            void *recv_scales, void *recv_count, void *src_info, void *range,
                            epx_ll_dispatch_result_t *result);

/* ---------------------------------------------------------------- validation */

/* Element at [i][j] of a 2-d tensor with its strides resolved (contiguous if 0). */
int64_t epx__tensor_row_stride(const epx_tensor_t *tensor);
int epx__tensor_given(const epx_tensor_t *tensor);

/*
 * Check a tensor argument: given, dtype, ndim, shape (a dimension of -1 = any), inner
 * dimension contiguous. Errors name the argument: "dispatch: x has dtype fp32, expected
 * bf16 or fp8_e4m3".
 */
epx_status_t epx__check_tensor(const char *op, const char *name, const epx_tensor_t *tensor,
                               epx_dtype_t dtype, int ndim, int64_t dim0, int64_t dim1);

#endif /* EPX_INTERNAL_H */
