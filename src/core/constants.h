/*
 * Numeric constants shared by host code, the CUDA kernels and the low-latency plugin:
 * the fp8 formats and the vector width of the GPU copies (plain macros: C and CUDA
 * both read this file).
 */
#ifndef EPX_CORE_CONSTANTS_H
#define EPX_CORE_CONSTANTS_H

/* Channels of a token that share one fp8 scale (include/epx.h: hidden / 128 scales). */
#define EPX__FP8_BLOCK 128
/* Largest finite float8 e4m3 value: scales map a block's amax onto it. */
#define EPX__FP8_E4M3_MAX 448.0f
/* Channels of one packed UE8M0 scale word: four blocks' exponent bytes per int32. */
#define EPX__UE8M0_GROUP (4 * EPX__FP8_BLOCK)

/* Bytes of the vectors the GPU kernels move: rows they copy with 16-byte loads and
 * stores must start on (and be a multiple of) this many bytes. */
#define EPX__VECTOR_BYTES 16

#endif /* EPX_CORE_CONSTANTS_H */
