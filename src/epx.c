/*
 * API entry points for buffers and operations: validate, then hand to the backend.
 *
 * Operations on a buffer are collective. When one fails on this rank (bad input data,
 * peer failure, timeout), the buffer records the error and the backend tells the
 * peers, so that their waits end with EPX_ERR_REMOTE instead of a timeout. Every later
 * call on the buffer returns the recorded error: the ranks no longer agree on where
 * they are in the sequence of operations, so continuing could only hang or corrupt.
 *
 * One class of error is exempt: a call whose form is wrong (EPX_ERR_INVALID_ARG from
 * the argument checks: a struct size, a missing or extra tensor, a dtype or a shape, a
 * stale handle), found on this rank before anything is exchanged. Ranks run the same
 * code, so such a mistake is usually made, and refused, on every rank at once; then no
 * rank waits and poisoning the buffer would only throw it away. So the call returns the
 * error with no effect here, and the backend lets the peers that did enter the call
 * know (EPX_ERR_REMOTE naming this rank; theirs is then a failure like any other).
 * A backend without that means (no `refuse` entry: CUDA) poisons as before. Errors that
 * depend on this rank's data (more tokens than the buffer holds: EPX_ERR_CAPACITY;
 * expert ids out of range) differ between ranks, so they still poison and tell the
 * peers at once.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "core/objects.h"
#include "validate.h"

/* A collective operation failed on this rank: record it and tell the peers. */
epx_status_t epx__buffer_fail(epx_buffer_t buffer, epx_status_t status)
{
    const char *message = epx_last_error();
    epx__buffer_set_async_error(buffer, status, message);
    if (buffer->ops->abort != NULL)
        buffer->ops->abort(buffer, status, message);
    return status;
}

/*
 * A normal-mode call refused for its form on this rank, before any exchange: no effect
 * here; the peers waiting in the call learn it (see the file comment). A backend that
 * cannot say so treats it as any other failure.
 */
static epx_status_t refuse_call(epx_buffer_t buffer, epx_status_t status)
{
    if (buffer->ops->refuse == NULL)
        return epx__buffer_fail(buffer, status);
    buffer->ops->refuse(buffer, epx_last_error());
    buffer->refused = 1;
    return status;
}

/*
 * Normal mode after a rejoin (src/epx_ll_rejoin.c): refused on every rank alike, before
 * any exchange, so nobody waits and nothing is poisoned.
 */
static epx_status_t check_normal_mode(epx_buffer_t buffer, const char *op)
{
    if (!buffer->low_latency_only)
        return EPX_SUCCESS;
    return EPX_ERROR(EPX_ERR_INVALID_STATE,
                     "%s: this buffer serves low-latency mode only since rank %d rejoined it "
                     "(a rejoined rank has no normal-mode memory): make a new buffer for "
                     "normal mode",
                     op, buffer->rejoined);
}

/* Refuse to run an operation on a buffer that already failed. */
epx_status_t epx__buffer_check_usable(epx_buffer_t buffer, const char *op)
{
    /* A failure seen only by the device (a peer's abort during an enqueued kernel) counts. */
    if (buffer->ops->poll_async_error != NULL)
        buffer->ops->poll_async_error(buffer);
    int error = atomic_load(&buffer->async_error);
    if (error == EPX_SUCCESS)
        return EPX_SUCCESS;
    return EPX_ERROR((epx_status_t)error,
                     "%s: the buffer failed earlier and cannot be used (destroy it): %s", op,
                     buffer->async_message);
}

epx_status_t epx_buffer_size(epx_group_t group, const epx_buffer_config_t *config,
                             size_t *bytes_per_rank)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, "buffer_size", "group"));
    return epx__buffer_size(group, config, bytes_per_rank);
}

epx_status_t epx__buffer_size(epx_group_t group, const epx_buffer_config_t *config,
                              size_t *bytes_per_rank)
{
    EPX_CHECK(epx__validate_buffer_config(group, config));
    if (bytes_per_rank == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_size: bytes_per_rank is NULL");
    const epx__backend_ops_t *ops = epx__backend_find(group->backend);
    if (ops == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "buffer_size: backend %s is not built",
                         epx_backend_name(group->backend));
    size_t bytes = 0;
    epx_buffer_config_t full;
    epx__buffer_config_read(config, &full);
    EPX_CHECK(ops->buffer_size(group, &full, &bytes));
    *bytes_per_rank = bytes;
    return EPX_SUCCESS;
}

/* What each rank contributes to the agreement step of buffer creation. */
typedef struct {
    int32_t status;
    int32_t num_experts;
    int32_t num_topk;
    int32_t dispatch_dtype;
    int32_t low_latency_dtype;
    int32_t auto_register;
    int32_t pad;
    int64_t max_tokens_per_rank;
    int64_t hidden;
    int64_t max_low_latency_tokens;
} buffer_vote_t;

/*
 * Every rank learns whether every other rank's config was valid and the same, before any
 * rank allocates: a rank with a bad config must not leave the others waiting.
 */
static epx_status_t agree_on_config(epx_group_t group, const epx_buffer_config_t *config,
                                    epx_status_t local_status)
{
    buffer_vote_t mine;
    memset(&mine, 0, sizeof(mine));
    if (local_status == EPX_SUCCESS) {
        mine.num_experts = config->num_experts;
        mine.num_topk = config->num_topk;
        mine.dispatch_dtype = (int32_t)config->dispatch_dtype;
        mine.low_latency_dtype = (int32_t)config->low_latency_dtype;
        mine.auto_register = config->auto_register;
        mine.max_tokens_per_rank = config->max_tokens_per_rank;
        mine.hidden = config->hidden;
        mine.max_low_latency_tokens = config->max_low_latency_tokens;
    }
    buffer_vote_t *votes = calloc((size_t)group->world_size, sizeof(*votes));
    if (votes == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of memory");
    epx_status_t status =
        epx__bootstrap_vote(group->bootstrap, group->world_size, local_status, &mine, votes,
                            sizeof(mine), "buffer_create", "rejected its config");
    for (int r = 0; r < group->world_size && status == EPX_SUCCESS; r++) {
        const buffer_vote_t *v = &votes[r];
        if (v->num_experts != mine.num_experts || v->num_topk != mine.num_topk ||
            v->dispatch_dtype != mine.dispatch_dtype ||
            v->low_latency_dtype != mine.low_latency_dtype ||
            v->max_tokens_per_rank != mine.max_tokens_per_rank || v->hidden != mine.hidden ||
            v->max_low_latency_tokens != mine.max_low_latency_tokens)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "buffer_create: rank %d's config differs from rank %d's (every "
                               "rank must pass the same shape)",
                               r, group->rank);
        else if (v->auto_register != mine.auto_register)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "buffer_create: rank %d combines with auto_register %s, rank %d "
                               "with %s (config.auto_register or EPX_AUTO_REGISTER must agree "
                               "on every rank)",
                               r, v->auto_register > 0 ? "on" : "off", group->rank,
                               mine.auto_register > 0 ? "on" : "off");
    }
    free(votes);
    return status;
}

struct epx_buffer *epx__buffer_new(epx_group_t group, const epx_buffer_config_t *config,
                                   const epx__backend_ops_t *ops)
{
    struct epx_buffer *buffer = calloc(1, sizeof(*buffer));
    if (buffer == NULL)
        return NULL;
    buffer->group = group;
    buffer->config = *config;
    if (buffer->config.num_sms == 0)
        buffer->config.num_sms = (int)epx__param_int(EPX_PARAM_NUM_SMS);
    buffer->num_local_experts = config->num_experts / group->world_size;
    buffer->ops = ops;
    atomic_init(&buffer->async_error, EPX_SUCCESS);
    atomic_init(&buffer->ll_peer_error, EPX_SUCCESS);
    static _Atomic uint64_t next_serial = 1;
    buffer->serial = atomic_fetch_add(&next_serial, 1);
    buffer->ll.tag = buffer->serial;
    buffer->rejoined = -1;
    return buffer;
}

epx_status_t epx_buffer_create(epx_group_t group, const epx_buffer_config_t *config,
                               epx_buffer_t *buffer_out)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_GROUP, group, "buffer_create", "group"));
    epx_status_t status = epx__validate_buffer_config(group, config);
    if (status == EPX_SUCCESS && buffer_out == NULL)
        status = EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_create: buffer is NULL");
    const epx__backend_ops_t *ops = epx__backend_find(group->backend);
    if (status == EPX_SUCCESS && ops == NULL)
        status = EPX_ERROR(EPX_ERR_UNSUPPORTED, "buffer_create: backend %s is not built",
                           epx_backend_name(group->backend));
    epx_buffer_config_t full;
    if (status == EPX_SUCCESS) {
        epx__buffer_config_read(config, &full);
        config = &full;
    }
    EPX_CHECK(agree_on_config(group, config, status));

    struct epx_buffer *buffer = epx__buffer_new(group, config, ops);
    if (buffer == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_create: out of memory");
    status = ops->buffer_create(buffer);
    if (status != EPX_SUCCESS) {
        free(buffer);
        return status;
    }
    status = epx__object_add(EPX__OBJECT_BUFFER, buffer);
    if (status != EPX_SUCCESS) {
        ops->buffer_destroy(buffer, 0);
        free(buffer);
        return status;
    }
    EPX_INFO(EPX_SUBSYS_CORE,
             "buffer: %s backend, %lld tokens/rank, hidden %lld, %d experts, top-%d, %d SMs",
             ops->name, (long long)config->max_tokens_per_rank, (long long)config->hidden,
             config->num_experts, config->num_topk, buffer->config.num_sms);
    *buffer_out = buffer;
    return EPX_SUCCESS;
}

/*
 * Destroy: collective while the buffer is healthy on this rank. Every rank first
 * finishes its queued work (a peer may still read this rank's memory), then votes that
 * it is done; memory allocated collectively (NVSHMEM's) is freed only when every rank
 * voted ready. A buffer that failed skips the vote (its peers may be gone).
 */
epx_status_t epx_buffer_destroy(epx_buffer_t buffer)
{
    epx__clear_error();
    if (buffer == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_destroy: buffer is NULL");
    /* Removal is the check: of two threads destroying the same buffer, one wins. */
    if (!epx__object_remove(EPX__OBJECT_BUFFER, buffer))
        return epx__object_check(EPX__OBJECT_BUFFER, buffer, "buffer_destroy", "buffer");
    epx_group_t group = buffer->group;
    int32_t ready = buffer->ops->destroy_ready != NULL ? buffer->ops->destroy_ready(buffer) : 1;
    epx_status_t status = EPX_SUCCESS;
    int all_ready = 0;
    /* Every rank must take the same branch here. No vote after a failure (it reached
     * every rank), nor after a call refused for its form (the peers that entered that
     * call failed it; when all refused it, all skip alike), nor when the caller
     * destroyed the group first (its channel is gone). */
    if (atomic_load(&buffer->async_error) == EPX_SUCCESS && !buffer->refused &&
        epx__object_live(EPX__OBJECT_GROUP, group)) {
        int32_t *votes = calloc((size_t)group->world_size, sizeof(int32_t));
        if (votes == NULL)
            status = EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "buffer_destroy: out of memory");
        else
            status = epx__bootstrap_allgather(group->bootstrap, &ready, votes, sizeof(ready));
        all_ready = status == EPX_SUCCESS;
        for (int r = 0; all_ready && r < group->world_size; r++)
            all_ready = votes[r] != 0;
        free(votes);
    }
    buffer->ops->buffer_destroy(buffer, all_ready);
    epx__object_retire(buffer);
    return status;
}

/*
 * Abort: this rank fails the buffer as a failed collective operation would, with the
 * caller's status and text (for a binding that found a bad argument itself).
 */
epx_status_t epx_buffer_abort(epx_buffer_t buffer, epx_status_t status, const char *message)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "buffer_abort", "buffer"));
    if (status == EPX_SUCCESS || strcmp(epx_status_name(status), "EPX_UNKNOWN_STATUS") == 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer_abort: status %d is not an error status of epx_status_t",
                         (int)status);
    /* epx__buffer_fail records and sends the thread's last error: make it the caller's. */
    EPX_ERROR(status, "%s",
              message != NULL && message[0] != '\0' ? message : "the caller aborted the buffer");
    epx__buffer_fail(buffer, status);
    epx__clear_error();
    return EPX_SUCCESS;
}

epx_status_t epx_get_async_error(epx_buffer_t buffer, epx_status_t *error, char *message,
                                 size_t message_size)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "get_async_error", "buffer"));
    if (error == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "get_async_error: error is NULL");
    if (buffer->ops->poll_async_error != NULL)
        buffer->ops->poll_async_error(buffer);
    int value = atomic_load(&buffer->async_error);
    const char *text = buffer->async_message;
    if (value == EPX_SUCCESS) {
        value = atomic_load(&buffer->ll_peer_error);
        text = buffer->ll_peer_message;
    }
    *error = (epx_status_t)value;
    if (message != NULL && message_size > 0)
        snprintf(message, message_size, "%s", value == EPX_SUCCESS ? "" : text);
    return EPX_SUCCESS;
}

epx_status_t epx_get_dispatch_layout(epx_buffer_t buffer, const epx_layout_args_t *args,
                                     void *stream)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "get_dispatch_layout", "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, "get_dispatch_layout"));
    /* Layout is local: a failure here does not involve (or poison) the peers. */
    EPX_CHECK(epx__validate_layout(buffer, args));
    if (buffer->ops->caps & EPX__BACKEND_HOST_TENSORS)
        EPX_CHECK(epx__validate_topk_values("get_dispatch_layout", &args->topk_idx,
                                            buffer->config.num_experts));
    return buffer->ops->layout(buffer, args, stream);
}

epx_status_t epx_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                          epx_dispatch_result_t *result, void *stream)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "dispatch", "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, "dispatch"));
    EPX_CHECK(check_normal_mode(buffer, "dispatch"));
    /* Args from before the layout-routing fields were appended: read as the full struct. */
    epx_dispatch_args_t full;
    if (args != NULL && args->size == offsetof(epx_dispatch_args_t, is_token_in_rank)) {
        epx__dispatch_args_read(args, &full);
        args = &full;
    }
    /* Cached mode takes its routing from the handle: topk_idx and topk_weights, if
     * given, are ignored (include/epx.h), so the backends never see them. */
    epx_dispatch_args_t cached;
    if (args != NULL && args->size == sizeof(*args) && args->handle != NULL) {
        cached = *args;
        cached.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
        cached.topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
        args = &cached;
    }
    /* The form of the call is checked on this rank alone, before anything is exchanged:
     * a mistake there has no effect (see the file comment). */
    epx_status_t status = epx__validate_dispatch(buffer, args, result);
    if (status == EPX_ERR_INVALID_ARG)
        return refuse_call(buffer, status);
    if (status == EPX_SUCCESS && args->handle == NULL &&
        (buffer->ops->caps & EPX__BACKEND_HOST_TENSORS)) {
        if (epx__tensor_given(&args->topk_idx))
            status = epx__validate_topk_values("dispatch", &args->topk_idx,
                                               buffer->config.num_experts);
        else
            status = epx__validate_layout_counts("dispatch", &args->num_tokens_per_expert);
    }
    epx_dispatch_result_t local;
    memset(&local, 0, sizeof(local));
    local.size = sizeof(local);
    if (status == EPX_SUCCESS)
        status = buffer->ops->dispatch(buffer, args, &local, stream);
    if (status != EPX_SUCCESS)
        return epx__buffer_fail(buffer, status);
    if (local.handle != NULL)
        local.handle->expert_alignment = args->handle != NULL ? args->handle->expert_alignment
                                                              : args->expert_alignment;
    *result = local;
    return EPX_SUCCESS;
}

epx_status_t epx_combine(epx_buffer_t buffer, const epx_combine_args_t *args, void *stream)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "combine", "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, "combine"));
    EPX_CHECK(check_normal_mode(buffer, "combine"));
    /* Args from before the bias or order fields were appended: read as the full struct. */
    epx_combine_args_t full;
    if (args != NULL && (args->size == offsetof(epx_combine_args_t, bias) ||
                         args->size == offsetof(epx_combine_args_t, order_topk_idx))) {
        epx__combine_args_read(args, &full);
        args = &full;
    }
    epx_status_t status = epx__validate_combine(buffer, args);
    if (status == EPX_ERR_INVALID_ARG)
        return refuse_call(buffer, status); /* the form of the call (see the file comment) */
    if (status == EPX_SUCCESS)
        status = buffer->ops->combine(buffer, args, stream);
    if (status != EPX_SUCCESS)
        return epx__buffer_fail(buffer, status);
    return EPX_SUCCESS;
}

epx_status_t epx_get_combine_input(epx_buffer_t buffer, epx_handle_t handle, epx_tensor_t *x)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "get_combine_input", "buffer"));
    EPX_CHECK(epx__object_check(EPX__OBJECT_HANDLE, handle, "get_combine_input", "handle"));
    if (x == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "get_combine_input: x is NULL");
    if (handle->buffer != buffer || handle->buffer_serial != buffer->serial)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "get_combine_input: handle was made by another buffer");
    EPX_CHECK(epx__buffer_check_usable(buffer, "get_combine_input"));
    EPX_CHECK(check_normal_mode(buffer, "get_combine_input"));
    if (buffer->ops->combine_input == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "get_combine_input: not supported by the %s backend",
                         buffer->ops->name);
    void *base = NULL;
    int64_t rows = 0;
    EPX_CHECK(buffer->ops->combine_input(buffer, &base, &rows));
    int64_t num_rows = handle->num_recv_tokens >= 0 ? handle->num_recv_tokens : rows;
    if (num_rows > rows)
        return EPX_ERROR(EPX_ERR_INTERNAL,
                         "get_combine_input: the handle has %lld rows, the region %lld",
                         (long long)num_rows, (long long)rows);
    *x = epx_tensor_2d(base, EPX_DTYPE_BF16, num_rows, buffer->config.hidden);
    return EPX_SUCCESS;
}
