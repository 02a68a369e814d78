/*
 * Bootstrap over collectives the caller supplies (a framework's own process group).
 * The library cannot see why a callback failed, only that it did, so every nonzero
 * return becomes EPX_ERR_BOOTSTRAP with the code it returned.
 */
#include <stdlib.h>

#include "bootstrap/bootstrap_impl.h"
#include "core/core.h"

static epx_status_t callbacks_allgather(epx__bootstrap_t *bootstrap, const void *send,
                                        void *recv, size_t bytes, const char *stage)
{
    const epx_bootstrap_callbacks_t *callbacks = bootstrap->impl;
    int code = callbacks->allgather(callbacks->ctx, send, recv, bytes);
    if (code != 0)
        return EPX_ERROR(EPX_ERR_BOOTSTRAP,
                         "bootstrap: the caller's allgather callback returned %d on rank %d "
                         "(%s of %zu bytes)",
                         code, bootstrap->rank, stage, bytes);
    return EPX_SUCCESS;
}

static epx_status_t callbacks_barrier(epx__bootstrap_t *bootstrap)
{
    const epx_bootstrap_callbacks_t *callbacks = bootstrap->impl;
    if (callbacks->barrier == NULL) {
        /* No barrier given: an allgather of one byte is one, since nobody can leave it
         * before everybody has contributed. */
        char mine = 0;
        char *all = calloc((size_t)bootstrap->world_size, 1);
        if (all == NULL)
            return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "bootstrap: barrier: out of memory");
        epx_status_t status = callbacks_allgather(bootstrap, &mine, all, 1, "barrier");
        free(all);
        return status;
    }
    int code = callbacks->barrier(callbacks->ctx);
    if (code != 0)
        return EPX_ERROR(EPX_ERR_BOOTSTRAP,
                         "bootstrap: the caller's barrier callback returned %d on rank %d", code,
                         bootstrap->rank);
    return EPX_SUCCESS;
}

static void callbacks_destroy(epx__bootstrap_t *bootstrap)
{
    free(bootstrap->impl);
}

static const epx__bootstrap_kind_t callbacks_kind = {
    .name = "callbacks",
    .allgather = callbacks_allgather,
    .barrier = callbacks_barrier,
    .destroy = callbacks_destroy,
};

epx_status_t epx__bootstrap_create_callbacks(const epx_bootstrap_callbacks_t *callbacks,
                                             int rank, int world_size,
                                             epx__bootstrap_t **bootstrap)
{
    if (callbacks == NULL || bootstrap == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: callbacks is NULL");
    if (callbacks->allgather == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "bootstrap: callbacks.allgather is NULL (it is required; barrier "
                         "may be NULL)");
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: rank %d is not in a world of %d",
                         rank, world_size);

    /* A copy, so the caller's struct may live on its stack. */
    epx_bootstrap_callbacks_t *copy = malloc(sizeof(*copy));
    if (copy == NULL)
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "bootstrap: out of memory");
    *copy = *callbacks;
    epx__bootstrap_t *created = epx__bootstrap_new(&callbacks_kind, rank, world_size, copy);
    if (created == NULL) {
        free(copy);
        return EPX_ERROR(EPX_ERR_OUT_OF_MEMORY, "bootstrap: out of memory");
    }
    EPX_DEBUG(EPX_SUBSYS_BOOTSTRAP, "bootstrap: rank %d of %d uses caller callbacks", rank,
              world_size);
    *bootstrap = created;
    return EPX_SUCCESS;
}
