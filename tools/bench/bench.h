/*
 * `epx bench`, shared between its files: the options, the per-dtype case runner of the
 * normal mode (bench_case.c), the low-latency mode (bench_ll.c) and the checks against
 * the oracle (bench_check.c).
 */
#ifndef EPX_TOOLS_BENCH_H
#define EPX_TOOLS_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "bench_memory.h"
#include "bench_report.h"
#include "bench_soak.h"
#include "epx.h"

typedef enum {
    EPX__BENCH_MODE_NORMAL = 0, /* layout, dispatch, cached dispatch, combine (bench_case.c) */
    EPX__BENCH_MODE_LL = 1,     /* low-latency dispatch and combine (bench_ll.c) */
    EPX__BENCH_MODE_FANOUT = 2, /* the fan-out copy of dispatch alone, and the fan-in sum
                                   of combine (bench_fanout.c) */
} epx__bench_mode_t;

typedef struct {
    epx__bench_mode_t mode;
    int64_t tokens; /* ll: also the buffer's max_low_latency_tokens */
    int64_t hidden;
    int experts;
    int topk;
    int run_bf16;
    int run_fp8;
    int warmup; /* -1 = the backend's default */
    int iters;  /* -1 = the backend's default */
    int back_to_back; /* normal: calls timed back to back; -1 = the backend's default */
    uint64_t seed;
    int alignment;
    int sms; /* 0 = EPX_NUM_SMS */
    epx_backend_t backend;
    int check;
    int json;
    double floor_bw_gbps; /* 0 = measure at the start (rank 0) */
    int num_ranks;        /* -n; 0 = not given */
    double timeout_s;     /* for the launch that -n starts */
    int use_mps;          /* the launch that -n starts runs a CUDA MPS daemon */
    int round_scale;      /* ll, fp8: power-of-two scales */
    int use_ue8m0;        /* ll, fp8: scales as packed UE8M0 exponents (implies round_scale) */
    /* ll: the buffer's config.low_latency_dtype, BF16 or FP8_E4M3; INVALID (not given) =
     * FP8_E4M3 when the run dispatches fp8 only, else BF16. */
    epx_dtype_t ll_dtype;
    /* normal: the group's ranks per node (EPX_RANKS_PER_NODE of the launch); 0 = not
     * given. Given, or when the group spans nodes, the expected traffic across nodes is
     * printed too (bench_nodes.h). */
    int ranks_per_node;
    epx__soak_options_t soak; /* --soak DURATION and its flags (bench_soak.h) */
    double fanout;            /* fanout: destinations (fan-in: sources) per row on
                                 average; 0 = not given */
    int register_mb;          /* normal: combine_registered's allocation at least this many
                                 MiB (x at its start); 0 = the rows and one more; rounded up
                                 to 2 MiB unless register_exact */
    int register_exact;       /* normal: that allocation exactly the rows and one more */
    int auto_register;        /* normal: the buffer's config.auto_register 1 (else -1) */
    int wait_stats;           /* ll: every dispatch and combine adds its receive's waits to
                                 wait_recv_cost_stats, printed at the end (--wait-stats) */
} epx__bench_options_t;

/* Print "epx bench: rank R: WHAT failed: STATUS: message" and exit 1 on failure. */
void epx__bench_must(int rank, epx_status_t status, const char *what);

/* A buffer config of the flags' shape (--tokens, --hidden, --experts, --topk, --sms);
 * each mode sets its own fields on top. */
epx_buffer_config_t epx__bench_buffer_config(const epx__bench_options_t *options);

/*
 * Run one dispatch dtype collectively: run every op once (and check it against the
 * oracle with --check), then time `warmup` + `iters` iterations, then (back_to_back > 0)
 * the cached dispatch, the combine and the registered combine `back_to_back` calls each
 * in a row. Fills rows[op] (rank 0's times, bytes of every rank, checks combined over
 * every rank, the back-to-back times a call of the slowest rank). Returns 1 when some
 * rank's check failed, else 0. An epx call that fails ends the process (status 1).
 */
int epx__bench_run_case(epx_group_t group, const epx__bench_options_t *options,
                        epx__bench_device_t *device, epx_dtype_t dtype, int warmup, int iters,
                        int back_to_back, epx__bench_row_t rows[EPX__BENCH_OP_COUNT]);

/*
 * The low-latency mode (bench_ll.c): for each dispatch dtype asked for, run the ops once
 * (checked with --check), time them, and print the rows on rank 0. `context` holds the
 * run's settings and the floor bandwidth chosen by bench.c. Returns 1 when some rank's
 * check failed, else 0; an epx call that fails ends the process (status 1).
 */
int epx__bench_ll_run(epx_group_t group, const epx__bench_options_t *options,
                      epx__bench_device_t *device, const epx__bench_context_t *context);

/*
 * `epx bench --mode fanout` (bench_fanout.c): the fan-out copy of dispatch alone
 * (epx_fanout_copy), vector, bulk and staged kernels, and copy-engine copies; then the
 * fan-in sum of combine alone (epx_fanin_reduce); on rank 0's table.
 * Returns 0; an epx call that fails ends the process (status 1).
 */
int epx__bench_fanout_run(epx_group_t group, const epx__bench_options_t *options,
                          epx__bench_device_t *device, const epx__bench_context_t *context);

/*
 * `epx bench --soak` (bench_soak.c): rounds of fresh random shapes until the duration is
 * over, windows of percentiles, memory and failures, a summary. Returns 1 when a check
 * failed or an operation failed unexpectedly, 2 for options it cannot run, else 0.
 */
int epx__bench_soak_run(epx_group_t group, const epx__bench_options_t *options,
                        epx__bench_device_t *device);
/*
 * The replacement of a killed rank (started by the soak itself with --soak-rejoin ID):
 * form the rejoin's group, join the survivors' buffer (epx_buffer_create_rejoin) and run
 * the rest of the soak with them. Returns as epx__bench_soak_run.
 */
int epx__bench_soak_newcomer(const epx__bench_options_t *options, epx__bench_device_t *device);

/* Every rank's `bytes` at `mine` into `all` (rank order) through the group's rendezvous
 * channel: small, off the timed path. Ends the process on failure. */
void epx__bench_allgather(epx_group_t group, const void *mine, void *all, size_t bytes,
                          const char *what);

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
