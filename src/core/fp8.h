/*
 * The numeric constants of the fp8 formats, one place for host code, the CUDA kernels
 * and the low-latency plugin (plain macros: C and CUDA both read this file).
 */
#ifndef EPX_CORE_FP8_H
#define EPX_CORE_FP8_H

/* Channels of a token that share one fp8 scale (include/epx.h: hidden / 128 scales). */
#define EPX__FP8_BLOCK 128
/* Largest finite float8 e4m3 value: scales map a block's amax onto it. */
#define EPX__FP8_E4M3_MAX 448.0f
/* Channels of one packed UE8M0 scale word: four blocks' exponent bytes per int32. */
#define EPX__UE8M0_GROUP (4 * EPX__FP8_BLOCK)

#endif /* EPX_CORE_FP8_H */
