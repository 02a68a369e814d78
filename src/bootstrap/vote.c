/*
 * One status vote for every collective set-up step (bootstrap.h): buffer configs,
 * CUDA IPC mappings, NVSHMEM set-up, a backend's final readiness.
 */
#include <stdio.h>
#include <string.h>

#include "bootstrap/bootstrap.h"
#include "core/core.h"

epx_status_t epx__bootstrap_vote(epx__bootstrap_t *bootstrap, int world_size, epx_status_t local,
                                 void *mine, void *all, size_t bytes, const char *op,
                                 const char *what)
{
    /* The allgather may overwrite the thread's last error; keep this rank's reason. */
    char local_message[512] = "";
    if (local != EPX_SUCCESS)
        snprintf(local_message, sizeof(local_message), "%s", epx_last_error());
    int32_t status = (int32_t)local;
    memcpy(mine, &status, sizeof(status));
    epx_status_t gathered = epx__bootstrap_allgather(bootstrap, mine, all, bytes);
    if (local != EPX_SUCCESS)
        return EPX_ERROR(local, "%s", local_message);
    if (gathered != EPX_SUCCESS)
        return gathered;
    for (int r = 0; r < world_size; r++) {
        memcpy(&status, (const char *)all + (size_t)r * bytes, sizeof(status));
        if (status != EPX_SUCCESS)
            return EPX_ERROR(EPX_ERR_REMOTE, "%s: rank %d %s (%s)", op, r, what,
                             epx_status_string((epx_status_t)status));
    }
    return EPX_SUCCESS;
}
