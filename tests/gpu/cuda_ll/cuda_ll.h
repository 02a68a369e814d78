/*
 * tests/gpu/cuda_ll: low-latency mode on the CUDA backend against the oracle. What the
 * files of the program share: harness.c (failures, flags, watchdog, the host collective
 * between sub-tests), step.c (one step's inputs, expected results and device memory),
 * check.c (the exact checks of results), subtests.c (the sub-tests), main.c.
 */
#ifndef EPX_TESTS_GPU_CUDA_LL_H
#define EPX_TESTS_GPU_CUDA_LL_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "epx.h"
#include "moe_ll.h"

#define CUDA_OK(call)                                                                    \
    do {                                                                                 \
        cudaError_t err_ = (call);                                                       \
        if (err_ != cudaSuccess) {                                                       \
            fprintf(stderr, "cuda_ll: rank %d: %s:%d: %s: %s\n", g_rank, __FILE__,       \
                    __LINE__, #call, cudaGetErrorString(err_));                          \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/*
 * A failed library call fails the sub-test and skips to `label`: the next point where
 * all ranks meet (any_failure), so that every rank leaves the sub-test at the same
 * point and the next one starts in step.
 */
#define EPX_TRY(call, label)                                                             \
    do {                                                                                 \
        epx_status_t st_ = (call);                                                       \
        if (st_ != EPX_SUCCESS) {                                                        \
            fail(#call, "%s: %s", epx_status_name(st_), epx_last_error());               \
            goto label;                                                                  \
        }                                                                                \
    } while (0)

typedef struct {
    int64_t max_tokens; /* the buffer's max_low_latency_tokens (M) */
    int64_t tokens;     /* tokens every rank passes (<= M) */
    int64_t hidden;
    int experts_per_rank;
    int topk;
} shape_t;

typedef struct {
    moe_case_t c;
    moe_ll_cast_t cast;
    shape_t shape;
    const uint8_t *mask;
    moe_inputs_t in;
    moe_ll_expected_t e;
    uint16_t *y;        /* expert outputs of the oracle's rows, expert after expert */
    uint16_t *want;     /* combined output [tokens][hidden] */
} step_t;

typedef struct {
    void *x, *idx, *weights, *y, *out;
    size_t x_bytes, idx_bytes, weights_bytes, y_bytes, out_bytes;
} io_t;

extern int g_rank, g_world;
extern epx_group_t g_group;
extern cudaStream_t g_stream;
extern int g_failures;
extern int g_subtest_base;
extern int g_sms;
extern const shape_t small_shape;
extern int g_replays, g_split_replays;
extern uint64_t g_seed;

/* Record a failed check of the running sub-test (this rank), with a message. */
void fail(const char *what, const char *format, ...) __attribute__((format(printf, 2, 3)));
long long flag_value(int argc, char **argv, const char *name, long long fallback);
const char *flag_text(int argc, char **argv, const char *name, const char *fallback);
void on_watchdog(int signal_number);
void watchdog_arm(const char *subtest, unsigned seconds);
double now_s(void);
int sum_over_ranks(int mine, int *failed_ranks, int *failed_count);
int any_failure(void);
int64_t rows_of(const shape_t *shape);
void step_make(step_t *s, const shape_t *shape, uint64_t seed, moe_ll_cast_t cast,
                      const uint8_t *mask);
void step_free(step_t *s);
void *device_alloc(size_t bytes);
void io_alloc(io_t *io, const shape_t *shape);
void io_free(io_t *io);
void upload_expert_outputs(void *dst, const step_t *s);
void io_upload(io_t *io, const step_t *s);
epx_ll_dispatch_args_t dispatch_args(const io_t *io, const shape_t *shape,
                                            moe_ll_cast_t cast, uint32_t flags);
epx_tensor_t expert_tensor(void *data, const shape_t *shape);
epx_ll_combine_args_t combine_args(const io_t *io, const shape_t *shape,
                                          epx_ll_handle_t handle, epx_tensor_t x, uint32_t flags);
int combine_view(epx_buffer_t buffer, epx_ll_handle_t handle, const shape_t *shape,
                        const char *what, epx_tensor_t *view);
void view_strides(const epx_tensor_t *t, int64_t stride[EPX_MAX_DIMS]);
void copy_back(void *dst, const epx_tensor_t *t, int64_t block, int64_t first, int64_t n);
int64_t first_difference(const void *a, const void *b, size_t bytes);
void check_dispatch(const char *what, const step_t *s, const epx_ll_dispatch_result_t *r);
void check_combine(const char *what, const step_t *s, const void *out);
void check_buffer_state(const char *what, epx_buffer_t buffer, const uint8_t *mask);
epx_buffer_t make_buffer(const shape_t *shape);
void destroy_buffer(epx_buffer_t buffer, const char *what);
epx_status_t combine_step(epx_buffer_t buffer, const io_t *io, const shape_t *shape,
                                 epx_ll_handle_t handle, epx_tensor_t x, uint32_t flags);
epx_status_t dispatch_step(epx_buffer_t buffer, const io_t *io, const shape_t *shape,
                                  moe_ll_cast_t cast, uint32_t flags,
                                  epx_ll_dispatch_result_t *result);
void graph_test(const char *name, moe_ll_cast_t cast, int split, int replays);
void test_graph_fp8(void);
void test_graph_split(void);
void test_graph_bf16(void);
void test_overlap(void);
void test_masked(void);
void test_standard(void);
void test_rejoin_unsupported(void);

#endif /* EPX_TESTS_GPU_CUDA_LL_H */
