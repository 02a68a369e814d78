/*
 * The oracle of the low-latency mode (include/epx.h, docs/LOW_LATENCY.md), written from
 * the specification only, independently of the library: what each rank must receive
 * from epx_ll_dispatch (per local expert, rows ordered by source rank then source token;
 * bf16, or fp8 e4m3 with per-128-channel scales) and what epx_ll_combine must return.
 * Inputs come from moe_case.h, regenerated per rank from the seed.
 */
#ifndef EPX_MOE_LL_H
#define EPX_MOE_LL_H

#include <stdint.h>

#include "moe_case.h"

/* How the dispatch casts (use_fp8, round_scale, use_ue8m0 of epx_ll_dispatch_args_t). */
typedef struct {
    int use_fp8;
    int round_scale;
    int use_ue8m0;
} moe_ll_cast_t;

/*
 * moe_inputs_make (c->dtype must be BF16), then one twist the low-latency contract
 * covers: when k >= 2, token 0 names its first expert twice (one row is sent, the
 * weights of both entries count in combine).
 */
int moe_ll_inputs_make(const moe_case_t *c, int rank, moe_inputs_t *in);

typedef struct {
    int num_local;
    int64_t rows;           /* max_tokens * world_size */
    int32_t *count;         /* [L] */
    int32_t *src_rank;      /* [L][rows] */
    int32_t *src_token;     /* [L][rows] */
    void *x;                /* [L][rows][hidden] bf16 bits or e4m3 bytes */
    float *scales;          /* [L][rows][hidden/128] when fp8 (powers of two with round_scale) */
    int64_t *range;         /* [L][R] (begin << 32) | count */
    int64_t masked_entries; /* this rank's distinct (token, expert) pairs on masked ranks */
} moe_ll_expected_t;

/* `mask` [R] (1 = masked) or NULL. Returns 0, or -1 on out of memory. */
int moe_ll_oracle_dispatch(const moe_case_t *c, int rank, int64_t max_tokens, const uint8_t *mask,
                           moe_ll_cast_t cast, moe_ll_expected_t *out);
void moe_ll_expected_free(moe_ll_expected_t *e);

/* The output expert `expert` computes for token (src_rank, src_token): bf16 [hidden]. */
void moe_ll_expert_row(const moe_case_t *c, int64_t expert, int src_rank, int64_t src_token,
                       uint16_t *row);

/*
 * Combine at `rank`: out[t] = bf16(sum_j w_j * expert_row(e_j, rank, t)) in fp32, j in
 * order, entries -1 or on masked ranks skipped (the latter counted in *masked).
 */
int moe_ll_oracle_combine(const moe_case_t *c, int rank, const uint8_t *mask, uint16_t **out,
                          int64_t *masked);

/* float -> e4m3 (fn) by nearest representable value, ties to even, saturating at 448. */
uint8_t moe_ll_to_e4m3(float value);

#endif /* EPX_MOE_LL_H */
