/*
 * `epx bench --mode ll`, shared between the case runner (bench_ll.c) and its report
 * (bench_ll_report.c): the timed ops, the statistics of one op and the row printed.
 */
#ifndef EPX_TOOLS_BENCH_LL_H
#define EPX_TOOLS_BENCH_LL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "bench_report.h"
#include "epx.h"

/*
 * The whole calls first, then the split: a dispatch with EPX_LL_SEND_ONLY and its
 * epx_ll_receive, and the same for combine, each half timed alone (each after a host
 * barrier, so they include the ranks' launch skew). Then steps back to back, the way a
 * decode loop runs them: the ranks pace each other through the data, no host barrier.
 */
typedef enum {
    EPX__BENCH_LL_DISPATCH = 0,      /* epx_ll_dispatch: send and receive in one call */
    EPX__BENCH_LL_COMBINE = 1,       /* epx_ll_combine, x in the zero-copy buffer */
    EPX__BENCH_LL_DISPATCH_SEND = 2, /* epx_ll_dispatch with EPX_LL_SEND_ONLY */
    EPX__BENCH_LL_DISPATCH_RECV = 3, /* its epx_ll_receive */
    EPX__BENCH_LL_COMBINE_SEND = 4,  /* epx_ll_combine with EPX_LL_SEND_ONLY */
    EPX__BENCH_LL_COMBINE_RECV = 5,  /* its epx_ll_receive */
    /* Steps back to back with no host synchronisation between them (a decode loop): */
    EPX__BENCH_LL_LOOP_DISPATCH = 6, /* epx_ll_dispatch inside the loop */
    EPX__BENCH_LL_LOOP_COMBINE = 7,  /* epx_ll_combine inside the loop */
    EPX__BENCH_LL_LOOP_STEP = 8,     /* a whole step (dispatch + combine) */
    EPX__BENCH_LL_LOOP_SPLIT = 9,    /* a whole step, both ops sent and then received */
    /* Steps captured in a CUDA graph and replayed: the GPU's time, no host in it (CUDA
     * backend only; the host backend leaves the row empty). */
    EPX__BENCH_LL_GRAPH_STEP = 10,
    /* Where the isolated calls' tails come from (CUDA only, like the graph row): */
    EPX__BENCH_LL_LAUNCH_LAG = 11, /* how long after the first rank this rank left the host
                                    * barrier before the isolated dispatch (host clock) */
    EPX__BENCH_LL_DISPATCH_AFTER_LAST = 12, /* that dispatch's end counted from the last
                                             * rank's leaving the barrier */
    EPX__BENCH_LL_OP_COUNT = 13,
} epx__bench_ll_op_t;

const char *epx__bench_ll_op_name(epx__bench_ll_op_t op);

/* Median, nearest-rank p99 and mean of one series of times, in us. */
typedef struct {
    double median_us;
    double p99_us;
    double mean_us;
} epx__bench_stats_t;

/* The statistics of `count` values (not modified). */
epx__bench_stats_t epx__bench_stats(const double *values, int count);

/* The run: the same for every row. */
typedef struct {
    const epx__bench_context_t *context; /* backend, ranks, shape, SMs, iterations, floor */
    int round_scale;
    int use_ue8m0;
    int64_t buffer_bytes;    /* epx_buffer_size of the buffer's config, per rank */
    int64_t ll_buffer_bytes; /* of which max_low_latency_tokens adds */
    epx_dtype_t ll_dtype;    /* the buffer's low_latency_dtype: rows sized for bf16 or fp8 */
} epx__bench_ll_context_t;

/* One dispatch dtype x op. */
typedef struct {
    epx_dtype_t dtype; /* of the dispatch (combine is always bf16) */
    epx__bench_ll_op_t op;
    epx__bench_stats_t rank0;
    /* Of the slowest rank's time in each iteration: the floor is for all ranks at once. */
    epx__bench_stats_t slowest;
    const epx__bench_stats_t *per_rank; /* [ranks] */
    int64_t bytes_per_rank; /* rank 0's bytes sent: dispatch rows, or combine rows back */
    int64_t total_bytes;    /* the same summed over every rank */
    /* Bytes all ranks read and write together at the least (bench_report.h, the floor);
     * 0 for the send and receive halves, which have no floor of their own. */
    int64_t floor_bytes;
    int check; /* EPX__BENCH_CHECK_*, combined over ranks */
} epx__bench_ll_row_t;

void epx__bench_ll_print_header(FILE *out, const epx__bench_ll_context_t *ll);
void epx__bench_ll_print_row(FILE *out, const epx__bench_ll_context_t *ll,
                             const epx__bench_ll_row_t *row, int json);
/* The table's closing lines: every rank's median per op. */
void epx__bench_ll_print_per_rank(FILE *out, const epx__bench_ll_context_t *ll,
                                  const epx__bench_ll_row_t *rows, int count);

/*
 * --wait-stats: what each rank's receives added to wait_recv_cost_stats over the run's
 * calls of dtype `dtype`, `waits` [ranks][2][ranks] ns (dispatch, then combine; entry s
 * of rank r = how long r waited for rank s): a table in ms, or one JSON line.
 */
void epx__bench_ll_print_waits(FILE *out, const epx__bench_ll_context_t *ll, epx_dtype_t dtype,
                               const int64_t *waits, int json);

#endif /* EPX_TOOLS_BENCH_LL_H */
