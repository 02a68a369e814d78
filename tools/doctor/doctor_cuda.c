/*
 * dlopen loader for the CUDA driver API (see doctor_cuda.h). The versioned names
 * (_v2) are the ones cuda.h maps the plain names to since CUDA 3.2/11; asking for them
 * explicitly keeps the 64-bit size_t ABI whatever the driver's age.
 */
#include "doctor_cuda.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

/* dlsym returns void *; this is the POSIX-sanctioned way to store it in a function
 * pointer without a pedantic-only cast warning. */
#define LOAD(field, symbol)                                                          \
    do {                                                                             \
        *(void **)(&cuda->field) = dlsym(cuda->library, symbol);                     \
        if (cuda->field == NULL) {                                                   \
            snprintf(why, why_size, "libcuda.so.1 has no %s (driver too old?)", symbol); \
            goto fail;                                                               \
        }                                                                            \
    } while (0)

int epx__doctor_cuda_load(epx__doctor_cuda_t *cuda, char *why, size_t why_size)
{
    memset(cuda, 0, sizeof(*cuda));
    cuda->library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda->library == NULL) {
        const char *error = dlerror();
        snprintf(why, why_size, "%s", error != NULL ? error : "libcuda.so.1 not found");
        return -1;
    }
    LOAD(cuInit, "cuInit");
    LOAD(cuDriverGetVersion, "cuDriverGetVersion");
    LOAD(cuDeviceGetCount, "cuDeviceGetCount");
    LOAD(cuDeviceGet, "cuDeviceGet");
    LOAD(cuDeviceGetName, "cuDeviceGetName");
    LOAD(cuDeviceTotalMem, "cuDeviceTotalMem_v2");
    LOAD(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    LOAD(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
    LOAD(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    LOAD(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    LOAD(cuCtxSetCurrent, "cuCtxSetCurrent");
    LOAD(cuCtxSynchronize, "cuCtxSynchronize");
    LOAD(cuMemGetInfo, "cuMemGetInfo_v2");
    LOAD(cuMemAlloc, "cuMemAlloc_v2");
    LOAD(cuMemFree, "cuMemFree_v2");
    LOAD(cuMemsetD32, "cuMemsetD32_v2");
    LOAD(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    LOAD(cuIpcGetMemHandle, "cuIpcGetMemHandle");
    LOAD(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
    LOAD(cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
    LOAD(cuModuleLoadData, "cuModuleLoadData");
    LOAD(cuModuleGetFunction, "cuModuleGetFunction");
    LOAD(cuLaunchKernel, "cuLaunchKernel");
    LOAD(cuGetErrorName, "cuGetErrorName");
    LOAD(cuGetErrorString, "cuGetErrorString");
    return 0;
fail:
    dlclose(cuda->library);
    memset(cuda, 0, sizeof(*cuda));
    return -1;
}

#undef LOAD

void epx__doctor_cuda_unload(epx__doctor_cuda_t *cuda)
{
    /* The library stays loaded: the driver's own threads may still run in it, and the
     * process is a short-lived child anyway. */
    memset(cuda, 0, sizeof(*cuda));
}

const char *epx__doctor_cuda_error(const epx__doctor_cuda_t *cuda, int result)
{
    static char text[256];
    const char *name = NULL, *description = NULL;
    if (cuda->cuGetErrorName != NULL)
        cuda->cuGetErrorName(result, &name);
    if (cuda->cuGetErrorString != NULL)
        cuda->cuGetErrorString(result, &description);
    snprintf(text, sizeof(text), "%s (%s)", name != NULL ? name : "CUDA error",
             description != NULL ? description : "no description");
    return text;
}

int epx__doctor_cuda_use_device(const epx__doctor_cuda_t *cuda, int ordinal)
{
    int device = 0;
    void *context = NULL;
    int result = cuda->cuDeviceGet(&device, ordinal);
    if (result == EPX__CU_SUCCESS)
        result = cuda->cuDevicePrimaryCtxRetain(&context, device);
    if (result == EPX__CU_SUCCESS)
        result = cuda->cuCtxSetCurrent(context);
    return result;
}
