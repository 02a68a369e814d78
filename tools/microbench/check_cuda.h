/*
 * The microbenchmarks' error check (one-file programs, built without the project's
 * headers): a CUDA call that fails prints the program's name (EPX_MICROBENCH_NAME, a
 * string literal defined before this is included), the call and CUDA's message, and
 * exits with status 1.
 */
#ifndef EPX_TOOLS_MICROBENCH_CHECK_CUDA_H
#define EPX_TOOLS_MICROBENCH_CHECK_CUDA_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK_CUDA(call)                                                                   \
    do {                                                                                   \
        cudaError_t err_ = (call);                                                         \
        if (err_ != cudaSuccess) {                                                         \
            fprintf(stderr, EPX_MICROBENCH_NAME ": %s: %s\n", #call,                       \
                    cudaGetErrorString(err_));                                             \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

#endif /* EPX_TOOLS_MICROBENCH_CHECK_CUDA_H */
