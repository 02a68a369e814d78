/*
 * The bootstrap object shared by both kinds: argument checks, the "first failure
 * sticks" rule, and dispatch to the kind's vtable.
 */
#include <stdlib.h>
#include <string.h>

#include "bootstrap/bootstrap_impl.h"
#include "core/core.h"

epx__bootstrap_t *epx__bootstrap_new(const epx__bootstrap_kind_t *kind, int rank,
                                     int world_size, void *impl)
{
    epx__bootstrap_t *bootstrap = calloc(1, sizeof(*bootstrap));
    if (bootstrap == NULL)
        return NULL;
    bootstrap->kind = kind;
    bootstrap->rank = rank;
    bootstrap->world_size = world_size;
    bootstrap->impl = impl;
    bootstrap->failed = EPX_SUCCESS;
    return bootstrap;
}

/* Remember a collective's failure (its message is this thread's last error). */
static epx_status_t remember_failure(epx__bootstrap_t *bootstrap, epx_status_t status)
{
    if (status != EPX_SUCCESS && bootstrap->failed == EPX_SUCCESS) {
        bootstrap->failed = status;
        snprintf(bootstrap->failed_message, sizeof(bootstrap->failed_message), "%s",
                 epx_last_error());
    }
    return status;
}

static epx_status_t check_usable(const epx__bootstrap_t *bootstrap, const char *stage)
{
    if (bootstrap->failed == EPX_SUCCESS)
        return EPX_SUCCESS;
    return EPX_ERROR(bootstrap->failed, "bootstrap: %s refused: an earlier exchange failed (%s)",
                     stage, bootstrap->failed_message);
}

epx_status_t epx__bootstrap_allgather(epx__bootstrap_t *bootstrap, const void *send,
                                      void *recv, size_t bytes)
{
    if (bootstrap == NULL || recv == NULL || (send == NULL && bytes > 0))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: allgather given a NULL pointer");
    EPX_CHECK(check_usable(bootstrap, "allgather"));
    return remember_failure(bootstrap,
                            bootstrap->kind->allgather(bootstrap, send, recv, bytes, "allgather"));
}

epx_status_t epx__bootstrap_barrier(epx__bootstrap_t *bootstrap)
{
    if (bootstrap == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "bootstrap: barrier given a NULL bootstrap");
    EPX_CHECK(check_usable(bootstrap, "barrier"));
    return remember_failure(bootstrap, bootstrap->kind->barrier(bootstrap));
}

void epx__bootstrap_destroy(epx__bootstrap_t *bootstrap)
{
    if (bootstrap == NULL)
        return;
    bootstrap->kind->destroy(bootstrap);
    free(bootstrap);
}
