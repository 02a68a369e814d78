/*
 * Bench memory and timing per backend. The CUDA parts compile only with EPX_WITH_CUDA;
 * without it asking for the CUDA backend is EPX_ERR_UNSUPPORTED (the library would
 * already have refused to make such a group).
 */
#include "bench_memory.h"

#include <stdlib.h>
#include <string.h>

#include "common/tool.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime.h>

#define CUDA_CALL(call, what)                                                            \
    do {                                                                                 \
        cudaError_t cuda_error_ = (call);                                                \
        if (cuda_error_ != cudaSuccess)                                                  \
            return epx__tool_error(EPX_ERR_CUDA, "bench: %s: %s", (what),                      \
                             cudaGetErrorString(cuda_error_));                           \
    } while (0)
#endif

#ifdef EPX_WITH_CUDA
static int is_cuda(const epx__bench_device_t *device)
{
    return device->backend == EPX_BACKEND_CUDA;
}
#endif

epx_status_t epx__bench_device_init(epx__bench_device_t *device, epx_backend_t backend,
                                    int device_index)
{
    memset(device, 0, sizeof(*device));
    device->backend = backend;
    if (backend != EPX_BACKEND_CUDA)
        return EPX_SUCCESS;
#ifdef EPX_WITH_CUDA
    CUDA_CALL(cudaSetDevice(device_index), "cudaSetDevice");
    cudaStream_t stream;
    CUDA_CALL(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    device->stream = stream;
    for (int i = 0; i < EPX__BENCH_MAX_MARKS; i++) {
        cudaEvent_t event;
        CUDA_CALL(cudaEventCreate(&event), "cudaEventCreate");
        device->events[i] = event;
    }
    return EPX_SUCCESS;
#else
    (void)device_index;
    return epx__tool_error(EPX_ERR_UNSUPPORTED, "bench: this epx was built without CUDA");
#endif
}

void epx__bench_device_fini(epx__bench_device_t *device)
{
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        for (int i = 0; i < EPX__BENCH_MAX_MARKS; i++) {
            if (device->events[i] != NULL)
                cudaEventDestroy((cudaEvent_t)device->events[i]);
        }
        if (device->stream != NULL)
            cudaStreamDestroy((cudaStream_t)device->stream);
    }
#endif
    memset(device, 0, sizeof(*device));
}

epx_status_t epx__bench_alloc(const epx__bench_device_t *device, size_t bytes, void **data)
{
    if (bytes == 0)
        bytes = 1; /* empty tensors still get a pointer the library accepts as "given" */
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        void *memory = NULL;
        CUDA_CALL(cudaMalloc(&memory, bytes), "cudaMalloc");
        /* On the bench stream, which does not wait for the legacy default stream: a
         * plain cudaMemset there could land after an operation already wrote here. */
        cudaStream_t stream = (cudaStream_t)device->stream;
        cudaError_t error = cudaMemsetAsync(memory, 0, bytes, stream);
        if (error == cudaSuccess)
            error = cudaStreamSynchronize(stream);
        if (error != cudaSuccess) {
            cudaFree(memory);
            return epx__tool_error(EPX_ERR_CUDA, "bench: cudaMemset: %s", cudaGetErrorString(error));
        }
        *data = memory;
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    void *memory = calloc(1, bytes);
    if (memory == NULL)
        return epx__tool_error(EPX_ERR_OUT_OF_MEMORY, "bench: cannot allocate %zu bytes", bytes);
    *data = memory;
    return EPX_SUCCESS;
}

void epx__bench_free(const epx__bench_device_t *device, void *data)
{
    if (data == NULL)
        return;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        cudaFree(data);
        return;
    }
#endif
    (void)device;
    free(data);
}

epx_status_t epx__bench_copy_in(const epx__bench_device_t *device, void *dst, const void *src,
                                size_t bytes)
{
    if (bytes == 0)
        return EPX_SUCCESS;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        /* cudaMemcpy from pageable memory may return before the data has landed, and it
         * is not ordered with the bench stream: copy on the stream and wait for it. */
        cudaStream_t stream = (cudaStream_t)device->stream;
        CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync to device");
        CUDA_CALL(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    memcpy(dst, src, bytes);
    return EPX_SUCCESS;
}

epx_status_t epx__bench_fill(const epx__bench_device_t *device, void *data, int byte,
                             size_t bytes)
{
    if (bytes == 0)
        return EPX_SUCCESS;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        cudaStream_t stream = (cudaStream_t)device->stream;
        CUDA_CALL(cudaMemsetAsync(data, byte, bytes, stream), "cudaMemsetAsync");
        CUDA_CALL(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    memset(data, byte, bytes);
    return EPX_SUCCESS;
}

epx_status_t epx__bench_copy_rows_out(const epx__bench_device_t *device, void *dst,
                                      const void *src, int64_t rows, size_t row_bytes,
                                      size_t src_pitch)
{
    if (rows <= 0 || row_bytes == 0)
        return EPX_SUCCESS;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        /* The results were written in the bench stream's order, which a plain cudaMemcpy
         * (legacy default stream) does not wait for. */
        cudaStream_t stream = (cudaStream_t)device->stream;
        CUDA_CALL(cudaMemcpy2DAsync(dst, row_bytes, src, src_pitch, row_bytes, (size_t)rows,
                                    cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpy2DAsync to host");
        CUDA_CALL(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    for (int64_t r = 0; r < rows; r++)
        memcpy((char *)dst + (size_t)r * row_bytes, (const char *)src + (size_t)r * src_pitch,
               row_bytes);
    return EPX_SUCCESS;
}

epx_status_t epx__bench_graph_begin(epx__bench_device_t *device)
{
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        CUDA_CALL(cudaStreamBeginCapture((cudaStream_t)device->stream,
                                         cudaStreamCaptureModeThreadLocal),
                  "cudaStreamBeginCapture");
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    return epx__tool_error(EPX_ERR_UNSUPPORTED, "bench: CUDA graphs need the CUDA backend");
}

epx_status_t epx__bench_graph_end(epx__bench_device_t *device, void **graph)
{
    *graph = NULL;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        cudaGraph_t captured = NULL;
        cudaGraphExec_t exec = NULL;
        CUDA_CALL(cudaStreamEndCapture((cudaStream_t)device->stream, &captured),
                  "cudaStreamEndCapture");
        cudaError_t err = cudaGraphInstantiate(&exec, captured, 0);
        (void)cudaGraphDestroy(captured);
        CUDA_CALL(err, "cudaGraphInstantiate");
        *graph = exec;
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    return epx__tool_error(EPX_ERR_UNSUPPORTED, "bench: CUDA graphs need the CUDA backend");
}

epx_status_t epx__bench_graph_launch(epx__bench_device_t *device, void *graph)
{
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        CUDA_CALL(cudaGraphLaunch((cudaGraphExec_t)graph, (cudaStream_t)device->stream),
                  "cudaGraphLaunch");
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    (void)graph;
    return epx__tool_error(EPX_ERR_UNSUPPORTED, "bench: CUDA graphs need the CUDA backend");
}

void epx__bench_graph_destroy(void *graph)
{
#ifdef EPX_WITH_CUDA
    if (graph != NULL)
        (void)cudaGraphExecDestroy((cudaGraphExec_t)graph);
#else
    (void)graph;
#endif
}

epx_status_t epx__bench_mark(epx__bench_device_t *device, int index)
{
    if (index < 0 || index >= EPX__BENCH_MAX_MARKS)
        return epx__tool_error(EPX_ERR_INTERNAL, "bench: timestamp index %d out of range", index);
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        CUDA_CALL(cudaEventRecord((cudaEvent_t)device->events[index],
                                  (cudaStream_t)device->stream),
                  "cudaEventRecord");
        return EPX_SUCCESS;
    }
#endif
    device->host_marks[index] = epx__tool_now_ns();
    return EPX_SUCCESS;
}

epx_status_t epx__bench_elapsed_us(epx__bench_device_t *device, int marks, double *durations_us)
{
    if (marks < 2 || marks > EPX__BENCH_MAX_MARKS)
        return epx__tool_error(EPX_ERR_INTERNAL, "bench: %d timestamps", marks);
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        CUDA_CALL(cudaStreamSynchronize((cudaStream_t)device->stream), "cudaStreamSynchronize");
        for (int i = 0; i + 1 < marks; i++) {
            float ms = 0;
            CUDA_CALL(cudaEventElapsedTime(&ms, (cudaEvent_t)device->events[i],
                                           (cudaEvent_t)device->events[i + 1]),
                      "cudaEventElapsedTime");
            durations_us[i] = (double)ms * 1e3;
        }
        return EPX_SUCCESS;
    }
#endif
    for (int i = 0; i + 1 < marks; i++)
        durations_us[i] = (double)(device->host_marks[i + 1] - device->host_marks[i]) / 1e3;
    return EPX_SUCCESS;
}

double epx__bench_host_copy_bandwidth(size_t bytes)
{
    char *src = malloc(bytes);
    char *dst = malloc(bytes);
    if (src == NULL || dst == NULL) {
        free(src);
        free(dst);
        return 0;
    }
    /* Touch both first, so the timed copies do not pay for page faults. */
    memset(src, 1, bytes);
    memset(dst, 0, bytes);
    int64_t best_ns = 0;
    for (int round = 0; round < 4; round++) {
        int64_t start = epx__tool_now_ns();
        memcpy(dst, src, bytes);
        int64_t elapsed = epx__tool_now_ns() - start;
        /* Read the copy back so the compiler cannot drop it. */
        src[round] = (char)(dst[bytes - 1 - (size_t)round] + 1);
        if (elapsed > 0 && (best_ns == 0 || elapsed < best_ns))
            best_ns = elapsed;
    }
    free(src);
    free(dst);
    if (best_ns == 0)
        return 0;
    return 2.0 * (double)bytes / (double)best_ns; /* bytes per ns = GB/s */
}

epx_status_t epx__bench_copy(const epx__bench_device_t *device, void *dst, const void *src,
                             size_t bytes)
{
    if (bytes == 0)
        return EPX_SUCCESS;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                  (cudaStream_t)device->stream),
                  "cudaMemcpyAsync device to device");
        return EPX_SUCCESS;
    }
#endif
    (void)device;
    memcpy(dst, src, bytes);
    return EPX_SUCCESS;
}

double epx__bench_copy_bandwidth(epx__bench_device_t *device, size_t bytes)
{
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        void *src = NULL, *dst = NULL;
        double best_us = 0;
        if (epx__bench_alloc(device, bytes, &src) == EPX_SUCCESS &&
            epx__bench_alloc(device, bytes, &dst) == EPX_SUCCESS) {
            /* The first copy warms up; the best of the others counts. */
            for (int round = 0; round < 6; round++) {
                double us = 0;
                if (epx__bench_mark(device, 0) != EPX_SUCCESS ||
                    epx__bench_copy(device, dst, src, bytes) != EPX_SUCCESS ||
                    epx__bench_mark(device, 1) != EPX_SUCCESS ||
                    epx__bench_elapsed_us(device, 2, &us) != EPX_SUCCESS) {
                    best_us = 0;
                    break;
                }
                if (round > 0 && us > 0 && (best_us == 0 || us < best_us))
                    best_us = us;
            }
        }
        epx__bench_free(device, src);
        epx__bench_free(device, dst);
        /* A failed allocation is reported by the return value, not left for the next
         * check of the last CUDA error. */
        (void)cudaGetLastError();
        return best_us > 0 ? 2.0 * (double)bytes / (best_us * 1e3) : 0;
    }
#endif
    (void)device;
    return epx__bench_host_copy_bandwidth(bytes);
}

double epx__bench_floor_bandwidth(epx__bench_device_t *device, size_t *bytes)
{
    size_t size = EPX__BENCH_FLOOR_FALLBACK_BYTES;
    double gbps = 0;
#ifdef EPX_WITH_CUDA
    if (is_cuda(device)) {
        size = EPX__BENCH_FLOOR_COPY_BYTES;
        gbps = epx__bench_copy_bandwidth(device, size);
    }
#endif
    if (gbps <= 0) {
        size = EPX__BENCH_FLOOR_FALLBACK_BYTES;
        gbps = epx__bench_copy_bandwidth(device, size);
    }
    if (bytes != NULL)
        *bytes = gbps > 0 ? size : 0;
    return gbps;
}
