/*
 * CUDA runtime failures as epx statuses (see cuda_status.h).
 */
#include "transport/cuda_status.h"

#include <stdarg.h>
#include <stdio.h>

epx_status_t epx__cuda_error(cudaError_t err, const char *file, int line, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    /* Non-sticky errors stay in the runtime's last-error slot until read. */
    (void)cudaGetLastError();
    epx_status_t status =
        err == cudaErrorMemoryAllocation ? EPX_ERR_OUT_OF_MEMORY : EPX_ERR_CUDA;
    return epx__error(status, file, line, "%s: %s (%s)", what, cudaGetErrorString(err),
                      cudaGetErrorName(err));
}
