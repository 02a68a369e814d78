/*
 * `epx bench`, shared between its files: the options, the per-dtype case runner
 * (bench_case.c) and the checks against the oracle (bench_check.c).
 */
#ifndef EPX_TOOLS_BENCH_H
#define EPX_TOOLS_BENCH_H

#include <stdint.h>

#include "bench_memory.h"
#include "bench_report.h"
#include "epx.h"

typedef struct {
    int64_t tokens;
    int64_t hidden;
    int experts;
    int topk;
    int run_bf16;
    int run_fp8;
    int warmup; /* -1 = the backend's default */
    int iters;  /* -1 = the backend's default */
    uint64_t seed;
    int alignment;
    int sms; /* 0 = EPX_NUM_SMS */
    epx_backend_t backend;
    int check;
    int json;
    double floor_bw_gbps; /* 0 = measure (host) or assume (cuda) */
    int num_ranks;        /* -n; 0 = not given */
    double timeout_s;     /* for the launch that -n starts */
    int use_mps;          /* the launch that -n starts runs a CUDA MPS daemon */
} epx__bench_options_t;

/* Print "epx bench: rank R: WHAT failed: STATUS: message" and exit 1 on failure. */
void epx__bench_must(int rank, epx_status_t status, const char *what);

/*
 * Run one dispatch dtype collectively: run every op once (and check it against the
 * oracle with --check), then time `warmup` + `iters` iterations. Fills rows[op] (rank
 * 0's times, bytes of every rank, checks combined over every rank). Returns 1 when some
 * rank's check failed, else 0. An epx call that fails ends the process (status 1).
 */
int epx__bench_run_case(epx_group_t group, const epx__bench_options_t *options,
                        epx__bench_device_t *device, epx_dtype_t dtype, int warmup, int iters,
                        epx__bench_row_t rows[EPX__BENCH_OP_COUNT]);

/*
 * Compare `rows` x `cols` elements of `dtype` exactly (bitwise). On the first
 * difference print "<label>: <what> differs at row R column C: got G, expected E" to
 * stderr and return 0; return 1 when equal.
 */
int epx__bench_compare(const char *label, const char *what, epx_dtype_t dtype, const void *got,
                       const void *expected, int64_t rows, int64_t cols);
/* The same for bf16 values, allowing `max_ulp` units in the last place. */
int epx__bench_compare_bf16(const char *label, const char *what, const uint16_t *got,
                            const uint16_t *expected, int64_t rows, int64_t cols, int max_ulp);

#endif /* EPX_TOOLS_BENCH_H */
