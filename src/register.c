/*
 * epx_buffer_register / epx_buffer_deregister (include/epx.h): the checks every backend
 * shares, the vote that makes every rank give the same kind of answer, and the slot
 * bookkeeping; the backend then maps the peers' ranges (CUDA: src/ops/cuda/registered.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "bootstrap/bootstrap.h"
#include "core/objects.h"
#include "ops/backend.h"
#include "ops/group.h"

typedef struct {
    int32_t status; /* set by the vote */
    int32_t slot;
} register_vote_t;

/* Every rank's status and slot; EPX_ERR_INVALID_ARG when the ranks chose different slots
 * (their register / deregister calls were not in the same order). */
static epx_status_t vote_slot(epx_buffer_t buffer, epx_status_t local, int slot, const char *op,
                              const char *what)
{
    epx_group_t group = buffer->group;
    register_vote_t mine = {0, slot};
    register_vote_t *all = calloc((size_t)group->world_size, sizeof(*all));
    if (all == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    epx_status_t status = epx__bootstrap_vote(group->bootstrap, group->world_size, local, &mine,
                                              all, sizeof(mine), op, what);
    for (int r = 0; r < group->world_size && status == EPX_SUCCESS; r++)
        if (all[r].slot != slot)
            status = EPX_ERROR(EPX_ERR_INVALID_ARG,
                               "%s: rank %d's call is for registered range %d, this rank's for "
                               "%d: every rank registers and deregisters in the same order",
                               op, r, all[r].slot, slot);
    free(all);
    return status;
}

static int overlaps(uintptr_t a, size_t a_bytes, uintptr_t b, size_t b_bytes)
{
    return a < b + b_bytes && b < a + a_bytes;
}

/* The local checks of a register call; on success *slot is the free slot it takes. */
static epx_status_t check_register(epx_buffer_t buffer, void *ptr, size_t bytes, int *slot)
{
    if (ptr == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_register: ptr is NULL");
    if (bytes == 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_register: bytes is 0");
    if ((uintptr_t)ptr + bytes < (uintptr_t)ptr)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer_register: the range wraps the address space");
    EPX_CHECK(epx__buffer_check_usable(buffer, "buffer_register"));
    if (buffer->low_latency_only)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "buffer_register: this buffer serves low-latency mode only since rank "
                         "%d rejoined it; ranges are for normal mode's combine",
                         buffer->rejoined);
    void *base = NULL;
    int64_t rows = 0;
    if (buffer->ops->combine_input != NULL && buffer->ops->combine_input(buffer, &base, &rows) ==
                                                  EPX_SUCCESS &&
        overlaps((uintptr_t)ptr, bytes, (uintptr_t)base,
                 (size_t)rows * (size_t)buffer->config.hidden * 2))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer_register: the range overlaps the buffer's combine-input region "
                         "(read in place already; register memory outside the buffer)");
    *slot = -1;
    for (int i = 0; i < EPX_MAX_REGISTERED; i++) {
        size_t b = buffer->registered[i].bytes;
        if (b == 0) {
            if (*slot < 0)
                *slot = i;
            continue;
        }
        if (overlaps((uintptr_t)ptr, bytes, (uintptr_t)buffer->registered[i].ptr, b))
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "buffer_register: [%p, +%zu) overlaps registered range %d [%p, "
                             "+%zu)",
                             ptr, bytes, i, (void *)buffer->registered[i].ptr, b);
    }
    if (*slot < 0)
        return EPX_ERROR(EPX_ERR_CAPACITY,
                         "buffer_register: %d ranges are registered already (at most "
                         "EPX_MAX_REGISTERED); deregister one first",
                         EPX_MAX_REGISTERED);
    return EPX_SUCCESS;
}

epx_status_t epx_buffer_register(epx_buffer_t buffer, void *ptr, size_t bytes)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "buffer_register", "buffer"));
    int slot = -1;
    epx_status_t status = check_register(buffer, ptr, bytes, &slot);
    EPX_CHECK(vote_slot(buffer, status, slot, "buffer_register", "refused its range"));
    buffer->registered[slot].ptr = ptr;
    buffer->registered[slot].bytes = bytes;
    if (buffer->ops->register_range == NULL)
        return EPX_SUCCESS;
    status = buffer->ops->register_range(buffer, slot);
    if (status != EPX_SUCCESS)
        memset(&buffer->registered[slot], 0, sizeof(buffer->registered[slot]));
    return status;
}

epx_status_t epx_buffer_deregister(epx_buffer_t buffer, void *ptr)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "buffer_deregister", "buffer"));
    int slot = -1;
    for (int i = 0; i < EPX_MAX_REGISTERED && ptr != NULL; i++)
        if (buffer->registered[i].bytes != 0 && buffer->registered[i].ptr == (char *)ptr)
            slot = i;
    epx_status_t status =
        slot >= 0 ? EPX_SUCCESS
                  : EPX_ERROR(EPX_ERR_INVALID_ARG,
                              "buffer_deregister: %p is not the start of a range registered on "
                              "this buffer",
                              ptr);
    EPX_CHECK(vote_slot(buffer, status, slot, "buffer_deregister", "refused the call"));
    if (buffer->ops->unregister_range != NULL)
        status = buffer->ops->unregister_range(buffer, slot);
    memset(&buffer->registered[slot], 0, sizeof(buffer->registered[slot]));
    return status;
}
