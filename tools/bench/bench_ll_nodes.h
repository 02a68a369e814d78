/*
 * `epx bench --mode ll` across nodes: the network traffic of low-latency mode's put path
 * (peers in other nodes), counted exactly from the routing, for each dispatch dtype.
 * docs/LOW_LATENCY.md ("The put path") describes the messages counted here.
 *
 * The model (kernels 2): a token sends one row per distinct expert it names; rows for
 * experts on ranks of other nodes are put, batched per (expert, receiver): the rows, the
 * fp8 scales (fp8 only), the source tokens (int32) and the top-k positions (int32, with
 * the signal), 4 puts a batch for fp8 and 3 for bf16, plus one put of the count words
 * ((E + 1) x 8 bytes, with its signal) to every rank of the other nodes per dispatch.
 * Combine pushes each such row back as one bf16 row with its signal. Also counted: the
 * rows a dispatch would put if it sent one row per (token, destination rank) instead of
 * one per (token, expert). The shape is normal mode's (bench_nodes.h); its dtype is not
 * read: each call names the dispatch dtype.
 */
#ifndef EPX_TOOLS_BENCH_LL_NODES_H
#define EPX_TOOLS_BENCH_LL_NODES_H

#include <stdint.h>
#include <stdio.h>

#include "bench_nodes.h"
#include "epx.h"

/* One rank's tokens, or summed over ranks. */
typedef struct {
    int64_t tokens;
    int64_t rows;    /* distinct (token, expert) pairs with the expert in another node */
    int64_t pairs;   /* distinct (token, rank) pairs with the rank in another node */
    int64_t batches; /* experts in other nodes that receive at least one row */
    int64_t peers;   /* ranks in other nodes (a count put each, per dispatch) */
} epx__bench_ll_nodes_counts_t;

/*
 * Count `tokens` rows of `topk_idx` ([tokens, num_topk], -1 = no expert) sent by rank
 * `rank` into `counts` (zeroed first). Returns 0, or -1 for an id outside
 * [-1, num_experts) or a shape that does not hold together.
 */
int epx__bench_ll_nodes_count(const epx__bench_nodes_shape_t *shape, int rank,
                              const int64_t *topk_idx, int64_t tokens,
                              epx__bench_ll_nodes_counts_t *counts);

/* What the put path sends for `counts`, dispatching in `dtype`. */
typedef struct {
    int64_t dispatch_messages;
    int64_t dispatch_bytes;      /* rows with scales, source tokens, positions; count words */
    int64_t dispatch_row_bytes;  /* one row's payload: the x row (+ fp8 scales) */
    int64_t combine_messages;
    int64_t combine_bytes;
} epx__bench_ll_nodes_traffic_t;

epx__bench_ll_nodes_traffic_t epx__bench_ll_nodes_traffic(const epx__bench_nodes_shape_t *shape,
                                                          epx_dtype_t dtype,
                                                          const epx__bench_ll_nodes_counts_t *counts);

/*
 * Rank 0's counts and every rank's, printed for one dispatch dtype: a table (with what
 * its figures mean when `explain`), or one JSON object per operation.
 */
void epx__bench_ll_nodes_print(FILE *out, const epx__bench_nodes_shape_t *shape,
                               epx_dtype_t dtype, const epx__bench_ll_nodes_counts_t *rank0,
                               const epx__bench_ll_nodes_counts_t *total, int json, int explain);

#endif /* EPX_TOOLS_BENCH_LL_NODES_H */
