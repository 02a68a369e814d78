/*
 * The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"), so that `epx
 * doctor` starts (and says "not present") on a machine without an NVIDIA driver. Only
 * the calls the doctor needs, with the ABI of cuda.h (CUdevice = int, CUdeviceptr =
 * 64-bit, versioned symbols such as cuMemAlloc_v2). Use it in a child process only
 * (doctor_child.h): a process that created a CUDA context must not fork.
 */
#ifndef EPX_TOOLS_DOCTOR_CUDA_H
#define EPX_TOOLS_DOCTOR_CUDA_H

#include <stddef.h>
#include <stdint.h>

/* cuda.h values the doctor uses. */
#define EPX__CU_SUCCESS 0
#define EPX__CU_ERROR_NO_DEVICE 100
#define EPX__CU_ATTR_MULTIPROCESSOR_COUNT 16
#define EPX__CU_ATTR_COMPUTE_CAPABILITY_MAJOR 75
#define EPX__CU_ATTR_COMPUTE_CAPABILITY_MINOR 76
#define EPX__CU_ATTR_CAN_USE_STREAM_MEM_OPS 92
#define EPX__CU_ATTR_GPU_DIRECT_RDMA_SUPPORTED 116
#define EPX__CU_ATTR_DMA_BUF_SUPPORTED 124
#define EPX__CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
#define EPX__CU_IPC_HANDLE_SIZE 64

typedef uint64_t epx__cu_deviceptr_t;
typedef struct {
    char reserved[EPX__CU_IPC_HANDLE_SIZE];
} epx__cu_ipc_handle_t;

typedef struct {
    void *library;
    int (*cuInit)(unsigned int flags);
    int (*cuDriverGetVersion)(int *version);
    int (*cuDeviceGetCount)(int *count);
    int (*cuDeviceGet)(int *device, int ordinal);
    int (*cuDeviceGetName)(char *name, int length, int device);
    int (*cuDeviceTotalMem)(size_t *bytes, int device);
    int (*cuDeviceGetAttribute)(int *value, int attribute, int device);
    int (*cuDeviceGetPCIBusId)(char *bus_id, int length, int device);
    int (*cuDeviceCanAccessPeer)(int *can, int device, int peer);
    int (*cuDevicePrimaryCtxRetain)(void **context, int device);
    int (*cuDevicePrimaryCtxRelease)(int device);
    int (*cuCtxSetCurrent)(void *context);
    int (*cuCtxSynchronize)(void);
    int (*cuMemGetInfo)(size_t *free_bytes, size_t *total_bytes);
    int (*cuMemAlloc)(epx__cu_deviceptr_t *pointer, size_t bytes);
    int (*cuMemFree)(epx__cu_deviceptr_t pointer);
    int (*cuMemsetD32)(epx__cu_deviceptr_t pointer, unsigned int value, size_t count);
    int (*cuMemcpyDtoH)(void *host, epx__cu_deviceptr_t device, size_t bytes);
    int (*cuIpcGetMemHandle)(epx__cu_ipc_handle_t *handle, epx__cu_deviceptr_t pointer);
    int (*cuIpcOpenMemHandle)(epx__cu_deviceptr_t *pointer, epx__cu_ipc_handle_t handle,
                              unsigned int flags);
    int (*cuIpcCloseMemHandle)(epx__cu_deviceptr_t pointer);
    int (*cuModuleLoadData)(void **module, const void *image);
    int (*cuModuleGetFunction)(void **function, void *module, const char *name);
    int (*cuLaunchKernel)(void *function, unsigned int grid_x, unsigned int grid_y,
                          unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                          unsigned int block_z, unsigned int shared_bytes, void *stream,
                          void **parameters, void **extra);
    int (*cuGetErrorName)(int result, const char **name);
    int (*cuGetErrorString)(int result, const char **text);
} epx__doctor_cuda_t;

/*
 * Load libcuda.so.1 and every symbol above. 0 on success; else -1 with `why` saying
 * what was missing (the dlerror text).
 */
int epx__doctor_cuda_load(epx__doctor_cuda_t *cuda, char *why, size_t why_size);
void epx__doctor_cuda_unload(epx__doctor_cuda_t *cuda);

/* "CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)" for a driver result. */
const char *epx__doctor_cuda_error(const epx__doctor_cuda_t *cuda, int result);

/*
 * Make device `ordinal`'s primary context current (for allocations and launches);
 * 0 on success, else the driver's result.
 */
int epx__doctor_cuda_use_device(const epx__doctor_cuda_t *cuda, int ordinal);

#endif /* EPX_TOOLS_DOCTOR_CUDA_H */
