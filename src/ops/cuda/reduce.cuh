/*
 * The fp32 sums of bf16 rows, shared by the combine kernels of one node (combine.cu,
 * combine_bulk.cu, in libepx) and, for the vector add and the final store, of several
 * (nvshmem/xn_reduce.cuh, in the NVSHMEM plugin, which keeps its own row loop: the row
 * loop below measured 16-31% slower there, 2026-12-03): header-only, so both libraries
 * inline the same code.
 *
 * Numerics: a 16-byte vector holds eight bf16 values; each is widened to fp32 and added
 * to its own accumulator, one fp32 add per row, in the order the caller passes the rows
 * (the reference's order: the CPU backend and the oracle add the same way, so results
 * are checked bit for bit). The sums are rounded to bf16 once, when stored.
 *
 * Layout of a warp's work: in a batch starting at vector i0, lane `lane` handles the
 * vectors i0 + u * 32 + lane for u < kUnroll (those below `units`), with the
 * accumulators acc[u][0..8) in registers.
 */
#ifndef EPX_OPS_CUDA_REDUCE_CUH
#define EPX_OPS_CUDA_REDUCE_CUH

#include <stdint.h>

#include "device.cuh"
#include "launch.h"

/* acc[0..8) += the eight bf16 values of v. */
__device__ __forceinline__ void epx_add_bf16x8(float *acc, int4 v)
{
    const uint32_t *w = reinterpret_cast<const uint32_t *>(&v);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        acc[2 * e] += epx_bf16_lo(w[e]);
        acc[2 * e + 1] += epx_bf16_hi(w[e]);
    }
}

/* acc += one row (a caller's tensor, such as a bias) aligned to `align` (see epx_ld16). */
template <int kUnroll>
__device__ __forceinline__ void epx_add_row(float (&acc)[kUnroll][8], const char *row, int align,
                                            int64_t i0, int64_t units, int lane)
{
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
        int64_t i = i0 + u * 32 + lane;
        if (i < units)
            epx_add_bf16x8(acc[u], epx_ld16(row + i * 16, align));
    }
}

/*
 * The start of token t's sums from byte `offset` of its row: 0, plus the caller's bias
 * rows when given (DeepEP's bias_0 + bias_1, added before the rows).
 */
template <int kUnroll>
__device__ __forceinline__ void epx_start_sums(float (&acc)[kUnroll][8],
                                               const epx__cuda_combine_args_t &a, int64_t t,
                                               int64_t offset, int64_t i0, int64_t units,
                                               int lane)
{
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
#pragma unroll
        for (int e = 0; e < 8; e++)
            acc[u][e] = 0.0f;
    for (int b = 0; b < 2; b++) {
        if (a.bias[b] != NULL) {
            const char *bias =
                static_cast<const char *>(a.bias[b]) + t * a.bias_stride[b] + offset;
            epx_add_row<kUnroll>(acc, bias, a.bias_align[b], i0, units, lane);
        }
    }
}

/*
 * acc += the n rows src[0, n) (16-byte aligned), in order: kGroup rows x kUnroll vectors
 * of loads in flight per lane, then the adds. `fresh` rows (written by a peer's put
 * during this kernel) are read through L2 only; the others through the read-only path.
 */
template <int kUnroll, int kGroup>
__device__ __forceinline__ void epx_add_rows(float (&acc)[kUnroll][8], const char *const *src,
                                             int n, int64_t i0, int64_t units, int lane,
                                             int fresh)
{
    for (int j0 = 0; j0 < n; j0 += kGroup) {
        int4 v[kGroup][kUnroll];
#pragma unroll
        for (int g = 0; g < kGroup; g++)
            if (j0 + g < n) {
                if (fresh) {
#pragma unroll
                    for (int u = 0; u < kUnroll; u++) {
                        const int64_t i = i0 + (int64_t)u * 32 + lane;
                        if (i < units)
                            v[g][u] = __ldcg(reinterpret_cast<const int4 *>(src[j0 + g]) + i);
                    }
                } else {
                    epx_ld16_batch<kUnroll>(v[g], src[j0 + g], i0, units, lane, 16);
                }
            }
#pragma unroll
        for (int g = 0; g < kGroup; g++) {
            if (j0 + g >= n)
                break;
#pragma unroll
            for (int u = 0; u < kUnroll; u++)
                epx_add_bf16x8(acc[u], v[g][u]);
        }
    }
}

/* The sums rounded to bf16, stored to `out` (aligned to `align`, see epx_st16). */
template <int kUnroll>
__device__ __forceinline__ void epx_store_sums(char *out, int align,
                                               const float (&acc)[kUnroll][8], int64_t i0,
                                               int64_t units, int lane)
{
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
        int64_t i = i0 + u * 32 + lane;
        if (i < units) {
            int4 packed;
            packed.x = (int)epx_pack_bf16(acc[u][0], acc[u][1]);
            packed.y = (int)epx_pack_bf16(acc[u][2], acc[u][3]);
            packed.z = (int)epx_pack_bf16(acc[u][4], acc[u][5]);
            packed.w = (int)epx_pack_bf16(acc[u][6], acc[u][7]);
            epx_st16(out + i * 16, packed, align);
        }
    }
}

#endif /* EPX_OPS_CUDA_REDUCE_CUH */
