/*
 * What `epx bench` prints: the statistics of the timed runs and the DeepEP-style
 * metrics (bytes per rank, bottleneck bandwidth, the copy floor), as a table with a
 * header or as one JSON object per line.
 */
#ifndef EPX_TOOLS_BENCH_REPORT_H
#define EPX_TOOLS_BENCH_REPORT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "epx.h"

typedef enum {
    EPX__BENCH_OP_LAYOUT = 0,
    EPX__BENCH_OP_DISPATCH = 1,
    EPX__BENCH_OP_CACHED_DISPATCH = 2,
    EPX__BENCH_OP_COMBINE = 3,      /* x in the buffer's combine-input view (zero-copy) */
    EPX__BENCH_OP_COMBINE_COPY = 4, /* x in a separate tensor (copied into the buffer) */
    EPX__BENCH_OP_COUNT = 5,
} epx__bench_op_t;

const char *epx__bench_op_name(epx__bench_op_t op);

/* The run: the same for every row. */
typedef struct {
    const char *backend;
    int ranks;
    int64_t tokens;
    int64_t hidden;
    int experts;
    int topk;
    int alignment;
    uint64_t seed;
    int sms;
    int warmup;
    int iters;
    double floor_bw_gbps;     /* 0 = unknown (floor columns print "-") */
    const char *floor_source; /* how floor_bw_gbps was obtained */
} epx__bench_context_t;

/* Check results. */
#define EPX__BENCH_CHECK_NONE (-1)
#define EPX__BENCH_CHECK_FAIL 0
#define EPX__BENCH_CHECK_PASS 1

/* One dtype x op. */
typedef struct {
    epx_dtype_t dtype;
    epx__bench_op_t op;
    double median_us;  /* rank 0's */
    double p99_us;     /* rank 0's */
    double slowest_us; /* median over iterations of the slowest rank's time */
    int64_t bytes_per_rank; /* rank 0's bytes over the link; 0 = no payload (layout) */
    int64_t total_bytes;    /* the same summed over every rank */
    int check;              /* EPX__BENCH_CHECK_* (combined over ranks) */
} epx__bench_row_t;

/* Median (mean of the middle two for an even count) and nearest-rank p99. Sorts. */
double epx__bench_median(double *values, int count);
double epx__bench_p99(double *values, int count);
/* Arithmetic mean; NaN for no values. */
double epx__bench_mean(const double *values, int count);

/* Time in us to move `bytes` (reads and writes both counted) at `bw_gbps` GB/s; NaN
 * when there are no bytes or no bandwidth. */
double epx__bench_copy_time_us(int64_t bytes, double bw_gbps);

/* Floor time in us: every rank's bytes read once and written once at the floor
 * bandwidth. NaN when not applicable. Compared with slowest_us: the floor is for all
 * ranks together. */
double epx__bench_floor_us(const epx__bench_context_t *context, const epx__bench_row_t *row);

/* Shared by both modes' reports: "%*.*f" of a finite number, else `missing` at that
 * width; ",\"key\":value" (null when not finite); bytes as "1.23 GiB" and the like. */
void epx__bench_print_number(FILE *out, int width, int precision, double value,
                             const char *missing);
void epx__bench_print_json_number(FILE *out, const char *key, double value);
void epx__bench_format_bytes(int64_t bytes, char *text, size_t size);

void epx__bench_print_header(FILE *out, const epx__bench_context_t *context);
void epx__bench_print_row(FILE *out, const epx__bench_context_t *context,
                          const epx__bench_row_t *row, int json);

#endif /* EPX_TOOLS_BENCH_REPORT_H */
