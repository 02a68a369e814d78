/*
 * CUDA runtime failures as epx statuses. Internal to the CUDA backend (transport and
 * ops): every failing CUDA call becomes EPX_ERR_CUDA (EPX_ERR_OUT_OF_MEMORY for an
 * allocation), with the call's purpose and CUDA's own text in the message.
 */
#ifndef EPX_TRANSPORT_CUDA_STATUS_H
#define EPX_TRANSPORT_CUDA_STATUS_H

#include <cuda_runtime_api.h>

#include "core/core.h"

/*
 * Record `err` (returns its status). `what` says what was being done, e.g.
 * "buffer_create: cudaMalloc of 480 MB". Clears CUDA's last-error state, so that an
 * unrelated later call does not report this failure again.
 */
epx_status_t epx__cuda_error(cudaError_t err, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define EPX_CUDA_ERROR(err, ...) epx__cuda_error((err), __FILE__, __LINE__, __VA_ARGS__)

/* Return early when a CUDA call fails; `...` describes the call. */
#define EPX_CUDA_CHECK(call, ...)                         \
    do {                                                  \
        cudaError_t epx_cuda_err_ = (call);               \
        if (epx_cuda_err_ != cudaSuccess)                 \
            return EPX_CUDA_ERROR(epx_cuda_err_, __VA_ARGS__); \
    } while (0)

#endif /* EPX_TRANSPORT_CUDA_STATUS_H */
