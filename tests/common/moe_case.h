/*
 * Deterministic MoE inputs and the pure reference of docs/DESIGN.md section 2 (the oracle).
 * Shared by the tests and `epx bench --check`. Every rank can regenerate every other
 * rank's inputs from the seed, so each rank computes its own expected results locally,
 * independently of any backend.
 */
#ifndef EPX_MOE_CASE_H
#define EPX_MOE_CASE_H

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

typedef enum {
    MOE_ROUTING_RANDOM = 0,        /* k distinct random experts per token */
    MOE_ROUTING_ONE_EXPERT = 1,    /* every token to expert 0 only (rest -1) */
    MOE_ROUTING_LOCAL_FIRST = 2,   /* random, but the first choice on the home rank */
    MOE_ROUTING_REPEAT = 3,        /* random, but the last entry repeats the first (k >= 2):
                                    * an expert named twice counts once (include/epx.h) */
} moe_routing_t;

typedef struct {
    int world_size;
    int64_t num_tokens;      /* tokens per rank (see empty_rank) */
    int64_t hidden;
    int num_experts;
    int num_topk;
    epx_dtype_t dtype;       /* BF16 or FP8_E4M3 */
    int expert_alignment;
    uint64_t seed;
    moe_routing_t routing;
    double drop_fraction;    /* fraction of top-k entries set to -1 */
    int empty_rank;          /* this rank passes 0 tokens; -1 = none */
    int ranks_per_node;      /* node size for combine's summation order (rank r is on
                                node r / ranks_per_node); 0 = all ranks on one node */
    int cancelling_rows;     /* combine rows (moe_combine_row): a token's lowest and highest
                                receivers send +2^16 and -2^16 (when it has three or more),
                                so that its sum depends on the order of the additions */
    uint64_t combine_salt;   /* 0, or another set of combine rows (moe_combine_row) for the
                                same inputs and routing: a step combined again with other
                                expert outputs */
} moe_case_t;

/* One rank's inputs, host memory. x is bf16 (uint16 bits) or fp8 bytes. */
typedef struct {
    int64_t num_tokens;
    void *x;              /* [num_tokens, hidden] */
    float *x_scales;      /* [num_tokens, hidden/128] when fp8, else NULL */
    int64_t *topk_idx;    /* [num_tokens, num_topk] */
    float *topk_weights;  /* [num_tokens, num_topk] */
} moe_inputs_t;

/* SplitMix64's finaliser: the mix every deterministic test input here is drawn from. */
uint64_t moe_splitmix64(uint64_t z);

/* Returns 0 on success, -1 on out of memory. Deterministic in (case, rank). */
int moe_inputs_make(const moe_case_t *c, int rank, moe_inputs_t *in);
void moe_inputs_free(moe_inputs_t *in);

/* What rank `rank` must receive from dispatch (docs/DESIGN.md section 2). */
typedef struct {
    int64_t num_recv;
    void *recv_x;              /* [num_recv, hidden] */
    float *recv_x_scales;      /* [num_recv, hidden/128] when fp8 */
    int64_t *recv_topk_idx;    /* [num_recv, num_topk] local ids or -1 */
    float *recv_topk_weights;  /* [num_recv, num_topk], 0 where idx is -1 */
    int32_t *recv_src_rank;    /* [num_recv] */
    int32_t *recv_src_token;   /* [num_recv] */
    int num_local_experts;
    int32_t *num_recv_per_expert; /* [num_local_experts], aligned */
    int32_t *num_tokens_per_rank;   /* layout of this rank's own inputs: [world_size] */
    int32_t *num_tokens_per_expert; /* [num_experts] */
    uint8_t *is_token_in_rank;      /* [num_tokens, world_size] */
} moe_expected_t;

int moe_oracle_dispatch(const moe_case_t *c, int rank, moe_expected_t *out);
void moe_expected_free(moe_expected_t *e);

/*
 * Combine input row for a token: the value rank `recv_rank` sends back for token
 * (src_rank, src_token), deterministic bf16 bits, one row of `hidden`.
 */
void moe_combine_row(const moe_case_t *c, int recv_rank, int src_rank, int64_t src_token,
                     uint16_t *row);
/*
 * Expected combine output for rank `rank`: [num_tokens, hidden] bf16 bits. For each
 * element of token t, with the ranks that received t grouped by node:
 *   partial_B = fp32 sum, in rank order from 0.0f, of the rows of node B's receivers
 *   out       = bf16( fp32 sum, in node order from 0.0f, of float(bf16(partial_B)) )
 * over the nodes B that received t. With one node this is bf16 of the flat fp32 sum in
 * rank order (bf16 of an exact bf16 is itself).
 */
int moe_oracle_combine(const moe_case_t *c, int rank, uint16_t **out_x);
/*
 * The same with DeepEP's biases, [num_tokens, hidden] bf16 bits each (NULL: none): the
 * fp32 sum starts from bias0 + bias1, then adds the node partials as above; on one node
 * the rows one by one, in rank order (nothing is rounded before the end).
 */
int moe_oracle_combine_biased(const moe_case_t *c, int rank, const uint16_t *bias0,
                              const uint16_t *bias1, uint16_t **out_x);
/*
 * The same with `topk_order` (epx_combine_args_t.order_topk_idx given the dispatch's
 * top-k ids): the receivers' rows in DeepEP V2's order, each where its rank's last entry
 * in the token's top-k row stands; across nodes each node's partial where its last
 * receiver stands, its receivers in that order. 0: as moe_oracle_combine_biased.
 */
int moe_oracle_combine_ordered(const moe_case_t *c, int rank, const uint16_t *bias0,
                               const uint16_t *bias1, int topk_order, uint16_t **out_x);

/* Top-k expert ids of rank `rank`'s tokens, [num_tokens, num_topk] (what
 * moe_inputs_make gives, without the rows). Returns the token count, -1 on a bad case. */
int64_t moe_routing_make(const moe_case_t *c, int rank, int64_t *topk_idx);
/* Tokens rank `rank` passes (0 for the case's empty rank). */
int64_t moe_tokens_of_rank(const moe_case_t *c, int rank);

/*
 * The size of an allocation meant for epx_buffer_register: `bytes` rounded up to a
 * multiple of 2 MiB, as PyTorch's caching allocator rounds large blocks (peers read a
 * registered allocation of any other size up to 1.7x slower on an H200:
 * docs/PERFORMANCE.md).
 */
size_t moe_registered_size(size_t bytes);

/* bf16 <-> fp32 (round to nearest even). */
float moe_bf16_to_float(uint16_t bits);
uint16_t moe_float_to_bf16(float value);

#endif /* EPX_MOE_CASE_H */
