/*
 * bf16 <-> fp32 for the host backend. bf16 is the top half of an fp32, so widening is
 * a shift; narrowing rounds to nearest even, like the GPU's __float2bfloat16_rn, so
 * that the host backend and the CUDA backend produce the same bits.
 */
#ifndef EPX_OPS_HOST_BF16_H
#define EPX_OPS_HOST_BF16_H

#include <stdint.h>
#include <string.h>

static inline float epx__bf16_to_float(uint16_t bits)
{
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof(value));
    return value;
}

static inline uint16_t epx__float_to_bf16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0)
        return (uint16_t)((bits >> 16) | 0x0040u); /* NaN stays a (quiet) NaN */
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)((bits + rounding) >> 16);
}

#endif /* EPX_OPS_HOST_BF16_H */
