/*
 * What `epx bench` prints: the statistics of the timed runs and the DeepEP-style
 * metrics (bytes per rank, bottleneck bandwidth), and the floor: the least time the
 * operation can take, all ranks at once, moving the bytes it must move through memory at
 * the copy bandwidth. Both modes report the same ratio, floor/time = floor_us / the
 * slowest rank's median (1.00 = at the floor, 0.50 = twice the floor's time), as a table
 * with a header or as one JSON object per line.
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
    EPX__BENCH_OP_COMBINE_REGISTERED = 5, /* x in a separate tensor registered with
                                             epx_buffer_register (read in place) */
    EPX__BENCH_OP_COMBINE_WEIGHTS = 6, /* x in the view, and the received top-k weights
                                          combined too (DeepEP's training path) */
    EPX__BENCH_OP_COUNT = 7,
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
    int sms; /* SMs per rank of the GPU kernels; 0 on the CPU backend (not printed) */
    int warmup;
    int iters;
    int back_to_back; /* normal: calls a back-to-back run times (0: none) */
    int auto_register; /* normal: combine_copy's x mapped on demand (--auto-register) */
    double floor_bw_gbps;     /* 0 = unknown (floor columns print "-") */
    const char *floor_source; /* how floor_bw_gbps was obtained */
    size_t floor_copy_bytes;  /* rank 0: the copy that measured it; 0 = given or assumed */
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
    /* Bytes all ranks must read and write together (epx__bench_floor_bytes); 0 = no floor. */
    int64_t floor_bytes;
    int check;              /* EPX__BENCH_CHECK_* (combined over ranks) */
    /* The slowest rank's time a call when the op ran back to back (epx bench
     * --back-to-back); 0 = not run so. */
    double back_to_back_us;
} epx__bench_row_t;

/* Median (mean of the middle two for an even count) and nearest-rank p99. Sorts. */
double epx__bench_median(double *values, int count);
double epx__bench_p99(double *values, int count);
/* Arithmetic mean; NaN for no values. */
double epx__bench_mean(const double *values, int count);

/* Time in us to move `bytes` (reads and writes both counted) at `bw_gbps` GB/s; NaN
 * when there are no bytes or no bandwidth. */
double epx__bench_copy_time_us(int64_t bytes, double bw_gbps);

/*
 * The bytes one op must move through memory, all ranks together (the floor of both
 * modes). Per rank, `tokens` source tokens and `received` rows arriving in dispatch (the
 * rows combine sends back); a source token is `source_row` bytes (x, its scales and its
 * routing), a received row `dispatch_row` bytes (x, scales, routing as delivered) and a
 * row combine reads or writes `combine_row` bytes (its weights and routing, when the op
 * reads them, go in `combine_token`, per output token):
 *   dispatch: each source token read once + each received row written once;
 *   combine:  each received row read once + each output row (and its routing) once.
 */
int64_t epx__bench_dispatch_floor_bytes(int64_t tokens, int64_t source_row, int64_t received,
                                        int64_t dispatch_row);
int64_t epx__bench_combine_floor_bytes(int64_t tokens, int64_t combine_token, int64_t received,
                                       int64_t combine_row);

/* Floor time in us: the row's floor bytes at the floor bandwidth; NaN when not
 * applicable. Compared with slowest_us: the floor is for all ranks together. */
double epx__bench_floor_us(const epx__bench_context_t *context, const epx__bench_row_t *row);
/* floor_us / time_us: 1.0 = at the floor; NaN when either is unknown. */
double epx__bench_floor_over_time(double floor_us, double time_us);
/* The bottleneck bandwidth in GB/s: rank 0's bytes over its median; NaN without either. */
double epx__bench_gbps(int64_t bytes_per_rank, double median_us);

/* Shared by both modes' reports: "%*.*f" of a finite number, else `missing` at that
 * width; ",\"key\":value" (null when not finite); bytes as "1.23 GiB" and the like. */
void epx__bench_print_number(FILE *out, int width, int precision, double value,
                             const char *missing);
void epx__bench_print_json_number(FILE *out, const char *key, double value);
void epx__bench_format_bytes(int64_t bytes, char *text, size_t size);
/* "fp8" or "bf16" (the bench's two dispatch dtypes); "PASS", "FAIL" or "-" for an
 * EPX__BENCH_CHECK_* value; a JSON row's last field, the check, and its closing brace. */
const char *epx__bench_dtype_text(epx_dtype_t dtype);
const char *epx__bench_check_text(int check);
void epx__bench_print_json_check_end(FILE *out, int check);

void epx__bench_print_header(FILE *out, const epx__bench_context_t *context);
/* Header pieces both modes print: ", SMs N" on the GPU backend only; the floor's
 * bandwidth, `what` it counts and the floor/time definition. */
void epx__bench_print_sms(FILE *out, const epx__bench_context_t *context);
void epx__bench_print_floor_header(FILE *out, const epx__bench_context_t *context,
                                   const char *what);
/* After a dtype's table: the rows timed back to back (back_to_back_us > 0), if any. */
void epx__bench_print_back_to_back(FILE *out, const epx__bench_context_t *context,
                                   const epx__bench_row_t *rows, int count);
void epx__bench_print_row(FILE *out, const epx__bench_context_t *context,
                          const epx__bench_row_t *row, int json);
/* The JSON fields of a row's traffic, the same in both modes: its bytes, GB/s per rank
 * (rank 0's median), the floor and floor/time (the slowest rank's median). */
void epx__bench_print_json_traffic(FILE *out, const epx__bench_context_t *context,
                                   int64_t bytes_per_rank, int64_t total_bytes,
                                   int64_t floor_bytes, double median_us, double slowest_us);

#endif /* EPX_TOOLS_BENCH_REPORT_H */
