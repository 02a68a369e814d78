/*
 * `epx bench` across nodes: the traffic that internode normal mode is expected to make,
 * counted exactly from the routing (the top-k ids), for a later comparison with what the
 * device measures. docs/INTERNODE.md describes the figures.
 *
 * The model (the design of internode normal mode): a token crosses the network once per
 * destination node other than its home node, as one record to the rank at the home
 * rank's position there (rank node * P + home % P, the forwarder), which delivers the
 * row to the ranks of its node that need it; rows for ranks of the home node go straight
 * to them. Combine reverses it: each node
 * reduces its rows to one bf16 partial, which crosses the network once. One network
 * message per record (the batching of records into puts is not known here).
 */
#ifndef EPX_TOOLS_BENCH_NODES_H
#define EPX_TOOLS_BENCH_NODES_H

#include <stdint.h>
#include <stdio.h>

#include "epx.h"
#include "epx_tool.h"

typedef struct {
    int world_size;
    int ranks_per_node; /* divides world_size */
    int num_experts;    /* a multiple of world_size; expert e is on rank e / (E / R) */
    int num_topk;
    int64_t hidden;
    epx_dtype_t dtype;  /* the dispatch dtype: BF16, or FP8_E4M3 with hidden / 128 fp32 scales */
} epx__bench_nodes_shape_t;

/* 1 when the shape holds together (node size divides the ranks, experts split evenly). */
int epx__bench_nodes_shape_valid(const epx__bench_nodes_shape_t *shape);

/* Counts of one rank's tokens, or summed over ranks. */
typedef struct {
    int64_t tokens;
    int64_t records;        /* (token, destination node other than the home node) pairs */
    int64_t home_rows;      /* rows for ranks of the home node, the home rank included */
    int64_t forwarded_rows; /* rows the forwarders deliver in the other nodes (theirs too) */
} epx__bench_nodes_counts_t;

/*
 * Count `tokens` rows of `topk_idx` ([tokens, num_topk], -1 = no expert) sent by rank
 * `home_rank` into `counts` (zeroed first). Returns 0, or -1 for an id outside
 * [-1, num_experts) or a shape that does not hold together.
 */
int epx__bench_nodes_count(const epx__bench_nodes_shape_t *shape, int home_rank,
                           const int64_t *topk_idx, int64_t tokens,
                           epx__bench_nodes_counts_t *counts);

typedef enum { EPX__BENCH_NODES_DISPATCH = 0, EPX__BENCH_NODES_COMBINE = 1 } epx__bench_nodes_op_t;

/* Byte sizes of one record and of one row moved inside a node, for an operation. */
typedef struct {
    int64_t payload;   /* dispatch: the x row (+ fp8 scales); combine: one bf16 partial row */
    int64_t overhead;  /* dispatch: K int64 ids + K fp32 weights + P int32 destination rows;
                          combine: K fp32 weights */
    int64_t local_row; /* a row delivered inside a node: dispatch's payload; combine's bf16 row */
} epx__bench_nodes_sizes_t;

epx__bench_nodes_sizes_t epx__bench_nodes_sizes(const epx__bench_nodes_shape_t *shape,
                                                epx__bench_nodes_op_t op);

/* What is printed for one dtype x operation. */
typedef struct {
    epx__bench_nodes_op_t op;
    epx_dtype_t dtype;
    epx__bench_nodes_sizes_t sizes;
    epx__bench_nodes_counts_t rank0; /* rank 0's tokens */
    epx__bench_nodes_counts_t total; /* every rank's tokens */
} epx__bench_nodes_row_t;

/* Network bytes (records x (payload + overhead)) and inside-node bytes of `counts`. */
int64_t epx__bench_nodes_network_bytes(const epx__bench_nodes_row_t *row,
                                       const epx__bench_nodes_counts_t *counts);
int64_t epx__bench_nodes_local_bytes(const epx__bench_nodes_row_t *row,
                                     const epx__bench_nodes_counts_t *counts);

/* The start of a traffic JSON line, up to "traffic_op" (`mode`: "normal" or "ll"); the
 * caller adds its figures and the closing brace. "traffic_op", not "op": these lines are
 * not timed rows (epx doctor reads "op"). */
void epx__bench_nodes_print_json_start(FILE *out, const char *mode,
                                       const epx__bench_nodes_shape_t *shape, epx_dtype_t dtype,
                                       const char *op);

/* The table's header (with what the figures mean when `explain`), then one line per
 * row; or one JSON object per row. */
void epx__bench_nodes_print_header(FILE *out, const epx__bench_nodes_shape_t *shape,
                                   int explain);
void epx__bench_nodes_print_row(FILE *out, const epx__bench_nodes_shape_t *shape,
                                const epx__bench_nodes_row_t *row, int json);

/*
 * How the CUDA backend lays out the run's internode normal mode (epx_internode_plan):
 * memory per rank (record and partial-sum slots, worst case or rings with credits) and
 * the split of the SM budget between sender, receiver and credit warps. Two comment
 * lines, or one JSON object ("internode_plan": true).
 */
void epx__bench_nodes_print_plan(FILE *out, const epx_internode_plan_t *plan, int json);

/*
 * Collective (tools/bench/bench_nodes_run.c): count this rank's routing of the run (made from
 * the seed, as the timed case makes it), gather every rank's counts, and print dispatch
 * and combine on rank 0 (`json`: JSON lines; else a table, with what its figures mean
 * when `explain`), after the internode plan of a CUDA group (when `explain`: once per
 * run). Ends the process on failure, like the rest of the bench.
 */
void epx__bench_nodes_report(epx_group_t group, int64_t tokens, int64_t hidden, int experts,
                             int topk, int sms, uint64_t seed, epx_dtype_t dtype, int json,
                             int explain);

#endif /* EPX_TOOLS_BENCH_NODES_H */
