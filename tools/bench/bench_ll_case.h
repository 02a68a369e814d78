/*
 * One case of `epx bench --mode ll` (bench_ll.c), shared by the files that run it:
 * bench_ll_ops.c (the calls), bench_ll_check.c (the first step and its checks against
 * the oracle), bench_ll_time.c (the timed iterations).
 */
#ifndef EPX_TOOLS_BENCH_LL_CASE_H
#define EPX_TOOLS_BENCH_LL_CASE_H

#include <stdint.h>

#include "bench.h"
#include "bench_ll.h"
#include "moe_ll.h"

typedef struct {
    epx_group_t group;
    const epx__bench_options_t *options;
    epx__bench_device_t *device;
    epx_buffer_t buffer;
    int rank;
    int world_size;
    int num_local; /* L */
    int64_t rows;  /* M * R: rows per local expert in the results */
    moe_case_t moe;
    moe_ll_cast_t cast;
    moe_inputs_t inputs;
    char label[64]; /* "rank 1 fp8", for messages */
    /* Backend memory. */
    void *x;
    void *topk_idx;
    void *topk_weights;
    void *out;
    /* --wait-stats: [R] int64 each, what the dispatches' and the combines' receives add
     * their waits to (wait_recv_cost_stats); NULL without. */
    void *wait_stats[2];
    /* Learnt from the first step (every step receives the same rows in the same order). */
    int64_t sent_rows;     /* (token, distinct expert) rows this rank sends */
    int64_t recv_rows;     /* rows it receives, which its combine sends back */
    int32_t *recv_count;   /* [L] */
    int64_t *expert_first; /* [L] row of expert_out where local expert l's rows start */
    uint16_t *expert_out;  /* [recv_rows, hidden] bf16: what the experts send back */
    void *filled[2];       /* combine buffers that hold expert_out */
    int layout_ok;         /* the first step's counts and ranges were consistent */
    uint16_t *expected_out; /* --check: the oracle's combine output (checked again last) */
} ll_case_t;

int epx__bench_ll_is_fp8(const ll_case_t *lc);
void *epx__bench_ll_host_alloc(const ll_case_t *lc, size_t bytes, const char *what);
epx_ll_dispatch_result_t epx__bench_ll_run_dispatch(ll_case_t *lc, uint32_t flags);
void epx__bench_ll_run_receive(ll_case_t *lc, epx_ll_handle_t handle, const char *what);
void epx__bench_ll_run_combine(ll_case_t *lc, epx_ll_handle_t handle, const epx_tensor_t *x,
                               uint32_t flags);
epx_tensor_t epx__bench_ll_combine_input(ll_case_t *lc, epx_ll_handle_t handle);
int epx__bench_ll_check_combine(ll_case_t *lc, const char *what, const uint16_t *expected);
void epx__bench_ll_run_first(ll_case_t *lc, int32_t check[EPX__BENCH_LL_OP_COUNT]);
void epx__bench_ll_time_steps(ll_case_t *lc, int warmup, int iters,
                              double *times[EPX__BENCH_LL_OP_COUNT]);

#endif /* EPX_TOOLS_BENCH_LL_CASE_H */
