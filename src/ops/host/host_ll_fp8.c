/*
 * The low-latency dispatch's cast of a bf16 token row to fp8 e4m3 with one fp32 scale
 * per 128 channels (include/epx.h states the formula; the GPU kernels must match it bit
 * for bit). e4m3 here is the "fn" variant: bias 7, no infinities, largest finite 448,
 * subnormals down to 2^-9; conversion rounds to nearest even and saturates to +-448,
 * like the GPU's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
 */
#include <math.h>
#include <stdint.h>

#include "ops/host/bf16.h"
#include "ops/host/host_ll.h"

static uint8_t epx__float_to_e4m3(float value)
{
    uint8_t sign = signbit(value) ? 0x80 : 0x00;
    if (isnan(value))
        return 0x7f;
    float a = fabsf(value);
    if (a >= EPX__FP8_E4M3_MAX)
        return sign | 0x7e;
    if (a < 0.015625f) { /* below 2^-6: subnormal steps of 2^-9 */
        float steps = nearbyintf(ldexpf(a, 9)); /* exact scaling, then round to even */
        return sign | (uint8_t)steps;          /* 8 steps = 2^-6, encoded 0x08 */
    }
    int exponent;
    (void)frexpf(a, &exponent); /* a = f * 2^exponent, f in [0.5, 1) */
    exponent -= 1;              /* a = 1.m * 2^exponent */
    float mantissa = nearbyintf((ldexpf(a, -exponent) - 1.0f) * 8.0f);
    int bits = ((exponent + 7) << 3) + (int)mantissa; /* a carry moves into the exponent */
    if (bits > 0x7e)
        bits = 0x7e;
    return sign | (uint8_t)bits;
}

void epx__host_ll_cast_fp8(const uint16_t *row, int64_t hidden, int round_scale, uint8_t *out,
                           float *scales)
{
    for (int64_t g = 0; g < hidden / EPX__FP8_BLOCK; g++) {
        const uint16_t *in = row + g * EPX__FP8_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < EPX__FP8_BLOCK; i++) {
            float v = fabsf(epx__bf16_to_float(in[i]));
            amax = v > amax ? v : amax; /* a NaN never raises amax */
        }
        amax = amax > 1e-4f ? amax : 1e-4f;
        float scale, multiplier;
        if (round_scale) {
            /* Smallest power of two >= amax / 448: frexp is exact, so is the rounding. */
            int exponent;
            float fraction = frexpf(amax / EPX__FP8_E4M3_MAX, &exponent);
            if (fraction == 0.5f)
                exponent -= 1; /* already a power of two */
            scale = ldexpf(1.0f, exponent);
            multiplier = ldexpf(1.0f, -exponent);
        } else {
            scale = amax / EPX__FP8_E4M3_MAX;
            multiplier = EPX__FP8_E4M3_MAX / amax;
        }
        scales[g] = scale;
        for (int i = 0; i < EPX__FP8_BLOCK; i++)
            out[g * EPX__FP8_BLOCK + i] = epx__float_to_e4m3(epx__bf16_to_float(in[i]) * multiplier);
    }
}
