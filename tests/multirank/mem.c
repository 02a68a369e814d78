/*
 * Host or device memory for the multi-rank tests (see mem.h).
 */
#include "mem.h"

#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime.h>

#define CUDA_OK(call)                                                                   \
    do {                                                                                \
        cudaError_t cuda_err_ = (call);                                                 \
        if (cuda_err_ != cudaSuccess)                                                   \
            TEST_FAIL("%s: %s", #call, cudaGetErrorString(cuda_err_));                  \
    } while (0)
#endif

static int use_device = 0;

void mr_mem_init(epx_group_t group)
{
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    use_device = 0;
#ifdef EPX_WITH_CUDA
    if (info.backend == EPX_BACKEND_CUDA) {
        CUDA_OK(cudaSetDevice(info.device));
        use_device = 1;
    }
#endif
}

int mr_mem_is_device(void)
{
    return use_device;
}

/* Rounded up so that an empty tensor still has a distinct, non-NULL address. */
static size_t alloc_bytes(size_t bytes)
{
    return bytes < 64 ? 64 : bytes;
}

void *mr_mem_alloc(size_t bytes, int fill_byte)
{
    void *memory = NULL;
#ifdef EPX_WITH_CUDA
    if (use_device) {
        CUDA_OK(cudaMalloc(&memory, alloc_bytes(bytes)));
        CUDA_OK(cudaMemset(memory, fill_byte, alloc_bytes(bytes)));
        return memory;
    }
#endif
    memory = malloc(alloc_bytes(bytes));
    if (memory == NULL)
        TEST_FAIL("out of memory allocating %zu bytes", bytes);
    memset(memory, fill_byte, alloc_bytes(bytes));
    return memory;
}

void mr_mem_free(void *memory)
{
#ifdef EPX_WITH_CUDA
    if (use_device) {
        CUDA_OK(cudaFree(memory));
        return;
    }
#endif
    free(memory);
}

void mr_mem_to_device(void *dst, const void *host_src, size_t bytes)
{
    if (bytes == 0)
        return;
#ifdef EPX_WITH_CUDA
    if (use_device) {
        CUDA_OK(cudaMemcpy(dst, host_src, bytes, cudaMemcpyHostToDevice));
        return;
    }
#endif
    memcpy(dst, host_src, bytes);
}

void mr_mem_to_host(void *host_dst, const void *src, size_t bytes)
{
    if (bytes == 0)
        return;
#ifdef EPX_WITH_CUDA
    if (use_device) {
        /* Results are valid in stream order; the library used the default stream. */
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(host_dst, src, bytes, cudaMemcpyDeviceToHost));
        return;
    }
#endif
    memcpy(host_dst, src, bytes);
}

void *mr_mem_from_host(const void *host, size_t bytes)
{
    void *memory = mr_mem_alloc(bytes, 0);
    mr_mem_to_device(memory, host, bytes);
    return memory;
}

void mr_mem_sync(void)
{
#ifdef EPX_WITH_CUDA
    if (use_device)
        CUDA_OK(cudaDeviceSynchronize());
#endif
}
