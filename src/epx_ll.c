/*
 * Low-latency entry points (include/epx.h, docs/LOW_LATENCY.md): validate, keep the
 * state of the two slots, then hand the data movement to the backend.
 *
 * Failure policy. Everything refused here (bad arguments, misuse of the slots) is
 * found before the backend sends a byte, so it has no effect and the buffer stays
 * usable. A backend wait that fails on a peer (EPX_ERR_TIMEOUT, EPX_ERR_REMOTE) has
 * already masked that peer and completed the step with the others: the step goes on
 * exactly as if the call had succeeded (results written, handle valid, the slot in its
 * next state), the loss is recorded as the buffer's peer error (epx_get_async_error),
 * and the call returns it. So every survivor stays in step with the others, whichever
 * of its calls saw the loss, and a serving process survives a lost rank. Any other
 * backend failure abandons the step and poisons the buffer, as in normal mode.
 */
#include <string.h>

#include "api.h"
#include "core/objects.h"
#include "validate.h"

static epx_status_t ll_check_backend(epx_buffer_t buffer, const char *op, const void *entry)
{
    if (entry == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "%s: low-latency mode is not implemented by the %s backend yet", op,
                         buffer->ops->name);
    return EPX_SUCCESS;
}

/* A backend failure that is not a peer's: abandon the step and poison the buffer. */
static epx_status_t ll_fail(epx_buffer_t buffer, int slot, epx_status_t status)
{
    buffer->ll.slots[slot].state = EPX__LL_FREE;
    buffer->ll.slots[slot].combine_result = NULL;
    return epx__buffer_fail(buffer, status);
}

/*
 * Sort a backend status: a peer's failure (already masked, step completed) is recorded
 * as the buffer's peer error, kept in *peer (the first one of the call) and turned into
 * success for the step's bookkeeping; any other status is returned as it is.
 */
static epx_status_t ll_sort_peer_failure(epx_buffer_t buffer, epx_status_t status,
                                         epx_status_t *peer)
{
    if (status != EPX_ERR_TIMEOUT && status != EPX_ERR_REMOTE)
        return status;
    int expected = EPX_SUCCESS;
    if (atomic_compare_exchange_strong(&buffer->ll_peer_error, &expected, (int)status))
        snprintf(buffer->ll_peer_message, sizeof(buffer->ll_peer_message), "%s",
                 epx_last_error());
    if (*peer == EPX_SUCCESS)
        *peer = status;
    return EPX_SUCCESS;
}

static const char *ll_state_name(epx__ll_slot_state_t state)
{
    switch (state) {
    case EPX__LL_FREE:
        return "free";
    case EPX__LL_DISPATCH_SENT:
        return "dispatch sent, not received";
    case EPX__LL_DISPATCHED:
        return "dispatch received";
    case EPX__LL_COMBINE_SENT:
        return "combine sent, not received";
    case EPX__LL_COMBINED:
        return "combined";
    }
    return "?";
}

static epx_ll_handle_t ll_make_handle(epx_buffer_t buffer, int slot)
{
    epx_ll_handle_t handle = EPX_LL_HANDLE_NONE;
    handle.internal[0] = buffer->ll.tag;
    handle.internal[1] = (uint64_t)slot;
    handle.internal[2] = buffer->ll.slots[slot].generation;
    return handle;
}

/* The slot of a handle that belongs to this buffer and whose slot was not reused. */
static epx_status_t ll_resolve(epx_buffer_t buffer, epx_ll_handle_t handle, const char *op,
                               int *slot_out)
{
    if (handle.internal[0] != buffer->ll.tag || handle.internal[1] > 1 ||
        handle.internal[2] == 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: handle is not a low-latency handle of this buffer (from "
                         "epx_ll_dispatch on it)",
                         op);
    int slot = (int)handle.internal[1];
    const epx__ll_slot_t *s = &buffer->ll.slots[slot];
    if (handle.internal[2] != s->generation || s->state == EPX__LL_FREE)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "%s: handle is stale: its step (dispatch %llu of slot %d) was replaced "
                         "by a later dispatch, abandoned after a failure, or cleaned; a handle "
                         "lasts until the second dispatch after its own",
                         op, (unsigned long long)handle.internal[2], slot);
    *slot_out = slot;
    return EPX_SUCCESS;
}

/*
 * Args of an older accepted size, from before cumulative_local_expert_recv_stats or
 * wait_recv_cost_stats was appended, read as the full struct (the fields they lack read
 * as not given); any other args as they are, for the checks to judge.
 */
static const epx_ll_dispatch_args_t *ll_dispatch_args_read(const epx_ll_dispatch_args_t *args,
                                                           epx_ll_dispatch_args_t *full)
{
    if (args == NULL ||
        (args->size != offsetof(epx_ll_dispatch_args_t, cumulative_local_expert_recv_stats) &&
         args->size != offsetof(epx_ll_dispatch_args_t, wait_recv_cost_stats)))
        return args;
    memset(full, 0, sizeof(*full));
    memcpy(full, args, args->size);
    full->size = sizeof(*full);
    return full;
}

/* The same for combine args from before wait_recv_cost_stats was appended. */
static const epx_ll_combine_args_t *ll_combine_args_read(const epx_ll_combine_args_t *args,
                                                         epx_ll_combine_args_t *full)
{
    if (args == NULL || args->size != offsetof(epx_ll_combine_args_t, wait_recv_cost_stats))
        return args;
    memset(full, 0, sizeof(*full));
    memcpy(full, args, args->size);
    full->size = sizeof(*full);
    return full;
}

epx_status_t epx_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                             epx_ll_dispatch_result_t *result, void *stream)
{
    const char *op = "ll_dispatch";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, op));
    epx_ll_dispatch_args_t full;
    args = ll_dispatch_args_read(args, &full);
    EPX_CHECK(epx__validate_ll_dispatch(buffer, args, result));
    EPX_CHECK(ll_check_backend(buffer, op, (const void *)buffer->ops->ll_dispatch));
    if (buffer->ops->caps & EPX__BACKEND_HOST_TENSORS)
        EPX_CHECK(epx__validate_topk_values(op, &args->topk_idx, buffer->config.num_experts));
    int slot = buffer->ll.next_slot;
    epx__ll_slot_t *s = &buffer->ll.slots[slot];
    if (s->state == EPX__LL_DISPATCH_SENT || s->state == EPX__LL_COMBINE_SENT)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "%s: two low-latency operations are already in flight; slot %d, which "
                         "this dispatch would use, holds a %s: call epx_ll_receive on its "
                         "handle first",
                         op, slot, s->state == EPX__LL_DISPATCH_SENT ? "dispatch" : "combine");

    /* From here on every rank moves in step: the slot turns over even if the call fails. */
    buffer->ll.next_slot = slot ^ 1;
    s->generation++;
    s->num_tokens = args->x.shape[0];
    s->state = EPX__LL_DISPATCH_SENT;
    epx_ll_dispatch_result_t local = *result;
    epx_status_t peer = EPX_SUCCESS;
    epx_status_t status = ll_sort_peer_failure(
        buffer, buffer->ops->ll_dispatch(buffer, slot, args, &local, stream), &peer);
    if (status == EPX_SUCCESS && !(args->flags & EPX_LL_SEND_ONLY)) {
        status = ll_sort_peer_failure(buffer, buffer->ops->ll_dispatch_receive(buffer, slot, stream),
                                      &peer);
        if (status == EPX_SUCCESS)
            s->state = EPX__LL_DISPATCHED;
    }
    if (status != EPX_SUCCESS)
        return ll_fail(buffer, slot, status);
    local.size = sizeof(local);
    local.handle = ll_make_handle(buffer, slot);
    *result = local; /* also after a peer's failure: the step completed without it */
    return peer;
}

epx_status_t epx_ll_receive(epx_buffer_t buffer, epx_ll_handle_t handle, void *stream)
{
    const char *op = "ll_receive";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, op));
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    int slot = 0;
    EPX_CHECK(ll_resolve(buffer, handle, op, &slot));
    epx__ll_slot_t *s = &buffer->ll.slots[slot];
    epx_status_t status, peer = EPX_SUCCESS;
    if (s->state == EPX__LL_DISPATCH_SENT) {
        status = ll_sort_peer_failure(buffer, buffer->ops->ll_dispatch_receive(buffer, slot, stream),
                                      &peer);
        if (status == EPX_SUCCESS)
            s->state = EPX__LL_DISPATCHED;
    } else if (s->state == EPX__LL_COMBINE_SENT) {
        epx_ll_combine_result_t local = EPX_LL_COMBINE_RESULT_INIT;
        status = ll_sort_peer_failure(
            buffer, buffer->ops->ll_combine_receive(buffer, slot, &local, stream), &peer);
        if (status == EPX_SUCCESS) {
            s->state = EPX__LL_COMBINED;
            /* The result given to the send receives the final count (include/epx.h). */
            if (s->combine_result != NULL)
                s->combine_result->num_masked_entries = local.num_masked_entries;
            s->combine_result = NULL;
        }
    } else {
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "%s: nothing is pending for this handle (slot %d: %s); receive "
                         "completes a dispatch or combine made with EPX_LL_SEND_ONLY",
                         op, slot, ll_state_name(s->state));
    }
    if (status != EPX_SUCCESS)
        return ll_fail(buffer, slot, status);
    return peer;
}

epx_status_t epx_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                            epx_ll_combine_result_t *result, void *stream)
{
    const char *op = "ll_combine";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    EPX_CHECK(epx__buffer_check_usable(buffer, op));
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: args is NULL", op);
    epx_ll_combine_args_t full;
    args = ll_combine_args_read(args, &full);
    if (args->size != sizeof(epx_ll_combine_args_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: args.size is %zu, expected %zu (use EPX_LL_COMBINE_ARGS_INIT)", op,
                         args->size, sizeof(epx_ll_combine_args_t));
    if (result != NULL && result->size != sizeof(epx_ll_combine_result_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: result.size is %zu, expected %zu (use EPX_LL_COMBINE_RESULT_INIT)",
                         op, result->size, sizeof(epx_ll_combine_result_t));
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    EPX_CHECK(ll_check_backend(buffer, op, (const void *)buffer->ops->ll_combine));
    int slot = 0;
    EPX_CHECK(ll_resolve(buffer, args->handle, op, &slot));
    epx__ll_slot_t *s = &buffer->ll.slots[slot];
    if (s->state == EPX__LL_DISPATCH_SENT || s->state == EPX__LL_COMBINE_SENT)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "%s: this step's %s was sent with EPX_LL_SEND_ONLY and not received: "
                         "call epx_ll_receive on the handle first",
                         op, s->state == EPX__LL_DISPATCH_SENT ? "dispatch" : "combine");
    EPX_CHECK(epx__validate_ll_combine(buffer, args, s->num_tokens));
    if (buffer->ops->caps & EPX__BACKEND_HOST_TENSORS)
        EPX_CHECK(epx__validate_topk_values(op, &args->topk_idx, buffer->config.num_experts));

    s->state = EPX__LL_COMBINE_SENT;
    s->combine_result = NULL;
    epx_status_t peer = EPX_SUCCESS;
    epx_status_t status =
        ll_sort_peer_failure(buffer, buffer->ops->ll_combine(buffer, slot, args, stream), &peer);
    epx_ll_combine_result_t local = EPX_LL_COMBINE_RESULT_INIT;
    if (status == EPX_SUCCESS && !(args->flags & EPX_LL_SEND_ONLY)) {
        status = ll_sort_peer_failure(
            buffer, buffer->ops->ll_combine_receive(buffer, slot, &local, stream), &peer);
        if (status == EPX_SUCCESS)
            s->state = EPX__LL_COMBINED;
    } else if (status == EPX_SUCCESS) {
        local.num_masked_entries = -1; /* the receive writes the count into `result` */
        s->combine_result = result;
    }
    if (status != EPX_SUCCESS)
        return ll_fail(buffer, slot, status);
    if (result != NULL)
        *result = local;
    return peer;
}

epx_status_t epx_ll_get_combine_buffer(epx_buffer_t buffer, epx_ll_handle_t handle,
                                       epx_tensor_t *x)
{
    const char *op = "ll_get_combine_buffer";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    if (x == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: x is NULL", op);
    EPX_CHECK(epx__buffer_check_usable(buffer, op));
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    EPX_CHECK(ll_check_backend(buffer, op, (const void *)buffer->ops->ll_combine_buffer));
    int slot = 0;
    EPX_CHECK(ll_resolve(buffer, handle, op, &slot));
    void *base = NULL;
    EPX_CHECK(buffer->ops->ll_combine_buffer(buffer, slot, &base));
    epx_tensor_t view = EPX_TENSOR_NONE;
    view.data = base;
    view.dtype = EPX_DTYPE_BF16;
    view.ndim = 3;
    view.shape[0] = buffer->num_local_experts;
    view.shape[1] = buffer->config.max_low_latency_tokens * buffer->group->world_size;
    view.shape[2] = buffer->config.hidden;
    *x = view;
    return EPX_SUCCESS;
}

epx_status_t epx_ll_mask_rank(epx_buffer_t buffer, int rank)
{
    const char *op = "ll_mask_rank";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    EPX_CHECK(ll_check_backend(buffer, op, (const void *)buffer->ops->ll_mask_rank));
    if (rank < 0 || rank >= buffer->group->world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: rank %d is outside 0..%d", op, rank,
                         buffer->group->world_size - 1);
    if (rank == buffer->group->rank)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: rank %d cannot mask itself (mask failed peers)", op, rank);
    return buffer->ops->ll_mask_rank(buffer, rank);
}

epx_status_t epx_ll_get_masked(epx_buffer_t buffer, int32_t *mask, int count)
{
    const char *op = "ll_get_masked";
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    if (mask == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: mask is NULL", op);
    if (count < buffer->group->world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: count %d is less than the world size %d", op,
                         count, buffer->group->world_size);
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    EPX_CHECK(ll_check_backend(buffer, op, (const void *)buffer->ops->ll_get_masked));
    buffer->ops->ll_get_masked(buffer, mask);
    return EPX_SUCCESS;
}

epx_status_t epx_ll_clean_buffer(epx_buffer_t buffer, void *stream)
{
    const char *op = "ll_clean_buffer";
    (void)stream;
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, op, "buffer"));
    EPX_CHECK(epx__validate_ll_enabled(buffer, op));
    for (int slot = 0; slot < 2; slot++) {
        epx__ll_slot_state_t state = buffer->ll.slots[slot].state;
        if (state == EPX__LL_DISPATCH_SENT || state == EPX__LL_COMBINE_SENT)
            return EPX_ERROR(EPX_ERR_INVALID_STATE,
                             "%s: slot %d holds a %s; receive it before cleaning", op, slot,
                             ll_state_name(state));
    }
    /* Free slots keep their generations, so the old handles stay recognisably stale. */
    for (int slot = 0; slot < 2; slot++)
        buffer->ll.slots[slot].state = EPX__LL_FREE;
    return EPX_SUCCESS;
}
