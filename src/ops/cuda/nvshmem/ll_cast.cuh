/*
 * The low-latency dispatch's fp8 cast, shared by kernels 1 (ll_dispatch.cu) and 2
 * (ll2_dispatch.cu): per 128 channels, the same bits as the host oracle
 * (src/ops/host/host_ll_fp8.c; docs/LOW_LATENCY.md "fp8"): multiply, never divide the
 * channels, __fdiv_rn for the scale, saturating e4m3 with round to nearest even.
 */
#ifndef EPX_OPS_CUDA_NVSHMEM_LL_CAST_CUH
#define EPX_OPS_CUDA_NVSHMEM_LL_CAST_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/constants.h"

/* fp8 e4m3 of 16 bf16 channels (this lane's) with the 8-lane group's scale. */
static __device__ __forceinline__ int4 epx_ll_cast16(const int4 lo, const int4 hi,
                                                     int round_scale, float *scale_out)
{
    __nv_bfloat16 v[16];
    *reinterpret_cast<int4 *>(&v[0]) = lo;
    *reinterpret_cast<int4 *>(&v[8]) = hi;
    float f[16], amax = 0.0f;
    for (int i = 0; i < 16; i++) {
        f[i] = __bfloat162float(v[i]);
        amax = fmaxf(amax, fabsf(f[i]));
    }
    /* The 8 lanes of a 128-channel group share one amax. */
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    amax = amax > 1e-4f ? amax : 1e-4f;
    float scale, multiplier;
    if (round_scale) {
        int exponent;
        float fraction = frexpf(__fdiv_rn(amax, EPX__FP8_E4M3_MAX), &exponent);
        if (fraction == 0.5f)
            exponent -= 1;
        scale = ldexpf(1.0f, exponent);
        multiplier = ldexpf(1.0f, -exponent);
    } else {
        scale = __fdiv_rn(amax, EPX__FP8_E4M3_MAX);
        multiplier = __fdiv_rn(EPX__FP8_E4M3_MAX, amax);
    }
    *scale_out = scale;
    /* Two channels per conversion (the first in the low byte): the same bits as one at
     * a time, half the instructions. */
    int4 out;
    unsigned short *pairs = reinterpret_cast<unsigned short *>(&out);
    for (int i = 0; i < 16; i += 2)
        pairs[i / 2] = __nv_cvt_float2_to_fp8x2(
            make_float2(__fmul_rn(f[i], multiplier), __fmul_rn(f[i + 1], multiplier)),
            __NV_SATFINITE, __NV_E4M3);
    return out;
}

#endif /* EPX_OPS_CUDA_NVSHMEM_LL_CAST_CUH */
