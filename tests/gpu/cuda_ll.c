/*
 * Low-latency mode on the CUDA backend, checked against the oracle (tests/common/moe_ll.h)
 * in the ways only a GPU can be used. Run by scripts/gpu-check:
 *
 *   epx launch -n 8 --mps -- cuda_ll [--sms 16] [--replays 100] [--split-replays 20]
 *        [--seed 1] [--only TEXT] [--watchdog 300]
 *
 * Sub-tests (each on a fresh buffer; one PASS/FAIL/SKIP line each, printed by rank 0
 * once every rank has reported):
 *   graph fp8     one step (fp8 dispatch, expert outputs copied into the zero-copy
 *                 combine buffer with cudaMemcpyAsync, combine) captured on a non-default
 *                 stream and replayed --replays times, each replay with fresh inputs
 *                 copied into the captured tensors first;
 *   graph split   the same with EPX_LL_SEND_ONLY + epx_ll_receive inside the capture;
 *   graph bf16    the first with bf16 dispatch;
 *   overlap       outside graphs: dispatch A and B send-only, receive A and B, combine
 *                 A (zero-copy) and B (separate tensor), blocking, then send-only;
 *   masked rank   (4+ ranks) every rank masks one rank that sits the step out; its rows
 *                 are absent and its experts come back as zeros;
 *   standard case 128 tokens, hidden 7168, 256 experts, top-8, fp8, checked once.
 * Checks are exact: recv_count, recv_src_info, recv_layout_range, the fp8 bytes and
 * scales (or bf16 rows) and the combined output bits; the first mismatch of each kind is
 * printed with its indices and values. A kernel that gives up on a peer reports through
 * epx_get_async_error (checked after every step) and masks the peer (epx_ll_get_masked,
 * also checked). A sub-test that makes no progress for --watchdog seconds ends the
 * process with a message naming it (the device-side waits end after EPX_TIMEOUT_MS).
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "api.h"
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

static int g_rank = -1, g_world = 0;
static epx_group_t g_group;
static cudaStream_t g_stream;
static int g_failures = 0;     /* this rank's failed checks, all sub-tests so far */
static int g_subtest_base = 0; /* g_failures when the running sub-test started */
static int g_sms = 16;

static void fail(const char *what, const char *format, ...) __attribute__((format(printf, 2, 3)));

static void fail(const char *what, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fprintf(stderr, "cuda_ll: rank %d: %s: ", g_rank, what);
    vfprintf(stderr, format, args);
    fprintf(stderr, "\n");
    va_end(args);
    g_failures++;
}

/* ---------------------------------------------------------------- flags, watchdog */

static long long flag_value(int argc, char **argv, const char *name, long long fallback)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return atoll(argv[i + 1]);
    return fallback;
}

static const char *flag_text(int argc, char **argv, const char *name, const char *fallback)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return argv[i + 1];
    return fallback;
}

static char g_watchdog_message[256];
static size_t g_watchdog_length;

static void on_watchdog(int signal_number)
{
    (void)signal_number;
    if (write(STDERR_FILENO, g_watchdog_message, g_watchdog_length) < 0) {
        /* nothing more to do: exiting anyway */
    }
    _exit(3);
}

/* Unless alarm(0) comes within `seconds`, end the process with a message naming `subtest`. */
static void watchdog_arm(const char *subtest, unsigned seconds)
{
    int n = snprintf(g_watchdog_message, sizeof(g_watchdog_message),
                     "cuda_ll: rank %d: FAIL %s: not finished after %u s (a hang: see the "
                     "other ranks' logs)\n", g_rank, subtest, seconds);
    g_watchdog_length = n < 0 ? 0 : n >= (int)sizeof(g_watchdog_message)
                                        ? sizeof(g_watchdog_message) - 1 : (size_t)n;
    alarm(seconds);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Every rank's `mine` summed (a host collective, so also a barrier); the ranks whose
 * value is nonzero into failed_ranks (may be NULL). */
static int sum_over_ranks(int mine, int *failed_ranks, int *failed_count)
{
    int *all = calloc((size_t)g_world, sizeof(int));
    if (all == NULL)
        exit(1);
    epx_status_t status = epx__bootstrap_allgather(g_group->bootstrap, &mine, all, sizeof(int));
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_ll: rank %d: allgather between sub-tests: %s: %s\n", g_rank,
                epx_status_name(status), epx_last_error());
        exit(1);
    }
    int total = 0, n = 0;
    for (int r = 0; r < g_world; r++) {
        total += all[r];
        if (all[r] != 0 && failed_ranks != NULL)
            failed_ranks[n++] = r;
    }
    if (failed_count != NULL)
        *failed_count = n;
    free(all);
    return total;
}

/*
 * Did any rank fail in this sub-test so far? Every rank calls it at the same points
 * (before each step), which also keeps the ranks in step: nobody starts a step, and so
 * waits on a peer, while that peer is still computing its oracle.
 */
static int any_failure(void)
{
    return sum_over_ranks(g_failures - g_subtest_base, NULL, NULL) > 0;
}

/* ---------------------------------------------------------------- one step, host side */

typedef struct {
    int64_t max_tokens; /* the buffer's max_low_latency_tokens (M) */
    int64_t tokens;     /* tokens every rank passes (<= M) */
    int64_t hidden;
    int experts_per_rank;
    int topk;
} shape_t;

/* Inputs of one step, and what the oracle says this rank must receive and combine. */
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

static int64_t rows_of(const shape_t *shape)
{
    return shape->max_tokens * g_world;
}

static void step_make(step_t *s, const shape_t *shape, uint64_t seed, moe_ll_cast_t cast,
                      const uint8_t *mask)
{
    memset(s, 0, sizeof(*s));
    s->shape = *shape;
    s->cast = cast;
    s->mask = mask;
    moe_case_t c = {g_world, shape->tokens, shape->hidden, shape->experts_per_rank * g_world,
                    shape->topk, EPX_DTYPE_BF16, 1, seed, MOE_ROUTING_RANDOM, 0.1, -1, 0};
    s->c = c;
    if (moe_ll_inputs_make(&s->c, g_rank, &s->in) != 0 ||
        moe_ll_oracle_dispatch(&s->c, g_rank, shape->max_tokens, mask, cast, &s->e) != 0) {
        fprintf(stderr, "cuda_ll: rank %d: out of memory for the oracle\n", g_rank);
        exit(1);
    }
    int64_t total = 0, rows = s->e.rows, hidden = shape->hidden;
    for (int local = 0; local < s->e.num_local; local++)
        total += s->e.count[local];
    s->y = malloc((size_t)(total * hidden) * 2 + 2);
    if (s->y == NULL)
        exit(1);
    int64_t at = 0;
    for (int local = 0; local < s->e.num_local; local++)
        for (int64_t i = 0; i < s->e.count[local]; i++, at++) {
            int64_t row = local * rows + i;
            moe_ll_expert_row(&s->c, (int64_t)g_rank * s->e.num_local + local, s->e.src_rank[row],
                              s->e.src_token[row], s->y + at * hidden);
        }
    int64_t masked = 0;
    if (moe_ll_oracle_combine(&s->c, g_rank, mask, &s->want, &masked) != 0)
        exit(1);
}

static void step_free(step_t *s)
{
    moe_inputs_free(&s->in);
    moe_ll_expected_free(&s->e);
    free(s->y);
    free(s->want);
    memset(s, 0, sizeof(*s));
}

/* ---------------------------------------------------------------- device memory */

/* The tensors one step reads and writes, in device memory (the captured ones in graphs). */
typedef struct {
    void *x, *idx, *weights, *y, *out;
    size_t x_bytes, idx_bytes, weights_bytes, y_bytes, out_bytes;
} io_t;

static void *device_alloc(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes > 0 ? bytes : 16));
    return p;
}

static void io_alloc(io_t *io, const shape_t *shape)
{
    int64_t t = shape->tokens, h = shape->hidden, k = shape->topk;
    io->x_bytes = (size_t)(t * h) * 2;
    io->idx_bytes = (size_t)(t * k) * 8;
    io->weights_bytes = (size_t)(t * k) * 4;
    io->y_bytes = (size_t)((int64_t)shape->experts_per_rank * rows_of(shape) * h) * 2;
    io->out_bytes = (size_t)(t * h) * 2;
    io->x = device_alloc(io->x_bytes);
    io->idx = device_alloc(io->idx_bytes);
    io->weights = device_alloc(io->weights_bytes);
    io->y = device_alloc(io->y_bytes);
    io->out = device_alloc(io->out_bytes);
    CUDA_OK(cudaMemset(io->y, 0, io->y_bytes));
}

static void io_free(io_t *io)
{
    cudaFree(io->x);
    cudaFree(io->idx);
    cudaFree(io->weights);
    cudaFree(io->y);
    cudaFree(io->out);
    memset(io, 0, sizeof(*io));
}

/* The step's expert outputs into `dst` [L][M * R][hidden] bf16 (device), in stream order. */
static void upload_expert_outputs(void *dst, const step_t *s)
{
    int64_t rows = s->e.rows, hidden = s->shape.hidden, at = 0;
    for (int local = 0; local < s->e.num_local; local++) {
        int64_t n = s->e.count[local];
        if (n > 0)
            CUDA_OK(cudaMemcpyAsync((char *)dst + (size_t)(local * rows * hidden) * 2,
                                    s->y + at * hidden, (size_t)(n * hidden) * 2,
                                    cudaMemcpyHostToDevice, g_stream));
        at += n;
    }
}

/* The step's inputs and expert outputs into `io`, and NaN bits into its output. */
static void io_upload(io_t *io, const step_t *s)
{
    CUDA_OK(cudaMemcpyAsync(io->x, s->in.x, io->x_bytes, cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaMemcpyAsync(io->idx, s->in.topk_idx, io->idx_bytes, cudaMemcpyHostToDevice,
                            g_stream));
    CUDA_OK(cudaMemcpyAsync(io->weights, s->in.topk_weights, io->weights_bytes,
                            cudaMemcpyHostToDevice, g_stream));
    upload_expert_outputs(io->y, s);
    CUDA_OK(cudaMemsetAsync(io->out, 0xff, io->out_bytes, g_stream));
}

static epx_ll_dispatch_args_t dispatch_args(const io_t *io, const shape_t *shape,
                                            moe_ll_cast_t cast, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(io->x, EPX_DTYPE_BF16, shape->tokens, shape->hidden);
    args.topk_idx = epx_tensor_2d(io->idx, EPX_DTYPE_INT64, shape->tokens, shape->topk);
    args.use_fp8 = cast.use_fp8;
    args.round_scale = cast.round_scale;
    args.use_ue8m0 = cast.use_ue8m0;
    args.flags = flags;
    return args;
}

/* A [L, M * R, hidden] bf16 tensor over `data` (io->y, or the zero-copy view's memory). */
static epx_tensor_t expert_tensor(void *data, const shape_t *shape)
{
    epx_tensor_t t = EPX_TENSOR_NONE;
    t.data = data;
    t.dtype = EPX_DTYPE_BF16;
    t.ndim = 3;
    t.shape[0] = shape->experts_per_rank;
    t.shape[1] = rows_of(shape);
    t.shape[2] = shape->hidden;
    return t;
}

static epx_ll_combine_args_t combine_args(const io_t *io, const shape_t *shape,
                                          epx_ll_handle_t handle, epx_tensor_t x, uint32_t flags)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = x;
    args.topk_idx = epx_tensor_2d(io->idx, EPX_DTYPE_INT64, shape->tokens, shape->topk);
    args.topk_weights = epx_tensor_2d(io->weights, EPX_DTYPE_FP32, shape->tokens, shape->topk);
    args.out = epx_tensor_2d(io->out, EPX_DTYPE_BF16, shape->tokens, shape->hidden);
    args.flags = flags;
    return args;
}

/* The zero-copy combine input of `handle`, checked to be [L, M * R, hidden] bf16. */
static int combine_view(epx_buffer_t buffer, epx_ll_handle_t handle, const shape_t *shape,
                        const char *what, epx_tensor_t *view)
{
    epx_status_t status = epx_ll_get_combine_buffer(buffer, handle, view);
    if (status != EPX_SUCCESS) {
        fail(what, "epx_ll_get_combine_buffer: %s: %s", epx_status_name(status), epx_last_error());
        return -1;
    }
    if (view->data == NULL || view->dtype != EPX_DTYPE_BF16 || view->ndim != 3 ||
        view->shape[0] != shape->experts_per_rank || view->shape[1] != rows_of(shape) ||
        view->shape[2] != shape->hidden ||
        (view->strides[0] != 0 && view->strides[0] != rows_of(shape) * shape->hidden) ||
        (view->strides[1] != 0 && view->strides[1] != shape->hidden)) {
        fail(what, "combine buffer view is %p %s ndim %d [%lld, %lld, %lld], expected bf16 "
             "[%d, %lld, %lld] contiguous", view->data, epx_dtype_name(view->dtype), view->ndim,
             (long long)view->shape[0], (long long)view->shape[1], (long long)view->shape[2],
             shape->experts_per_rank, (long long)rows_of(shape), (long long)shape->hidden);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- checks */

/* Element strides of a result view (all 0 = contiguous, row major). */
static void view_strides(const epx_tensor_t *t, int64_t stride[EPX_MAX_DIMS])
{
    int contiguous = 1;
    for (int d = 0; d < t->ndim; d++)
        contiguous &= t->strides[d] == 0;
    int64_t running = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        stride[d] = contiguous ? running : t->strides[d];
        running *= t->shape[d];
    }
}

/*
 * Rows first..first+n-1 of block `block` of a 3-d view [blocks, rows, C] (or elements
 * first..first+n-1 of row `block` of a 2-d view [blocks, C]; or of a 1-d view) into
 * contiguous host memory. The stream has been synchronised.
 */
static void copy_back(void *dst, const epx_tensor_t *t, int64_t block, int64_t first, int64_t n)
{
    if (n <= 0)
        return;
    int64_t stride[EPX_MAX_DIMS];
    view_strides(t, stride);
    size_t element = epx_dtype_size(t->dtype);
    const char *base = (const char *)t->data;
    if (t->ndim == 1) { /* `block` is 0 */
        CUDA_OK(cudaMemcpy(dst, base + (size_t)(first * stride[0]) * element,
                           (size_t)n * element, cudaMemcpyDeviceToHost));
    } else if (t->ndim == 2) {
        CUDA_OK(cudaMemcpy(dst, base + (size_t)(block * stride[0] + first) * element,
                           (size_t)n * element, cudaMemcpyDeviceToHost));
    } else {
        size_t row = (size_t)t->shape[2] * element;
        const char *src = base + (size_t)(block * stride[0] + first * stride[1]) * element;
        CUDA_OK(cudaMemcpy2D(dst, row, src, (size_t)stride[1] * element, row, (size_t)n,
                             cudaMemcpyDeviceToHost));
    }
}

static int64_t first_difference(const void *a, const void *b, size_t bytes)
{
    const unsigned char *p = a, *q = b;
    for (size_t i = 0; i < bytes; i++)
        if (p[i] != q[i])
            return (int64_t)i;
    return -1;
}

/* The dispatch result `r` (received; the stream is synchronised here) against the oracle. */
static void check_dispatch(const char *what, const step_t *s, const epx_ll_dispatch_result_t *r)
{
    CUDA_OK(cudaStreamSynchronize(g_stream));
    const moe_ll_expected_t *e = &s->e;
    int world = g_world, num_local = e->num_local, fp8 = s->cast.use_fp8;
    int64_t rows = e->rows, hidden = s->shape.hidden, groups = hidden / 128;
    epx_dtype_t scale_dtype = s->cast.use_ue8m0 ? EPX_DTYPE_INT32 : EPX_DTYPE_FP32;
    int64_t scale_cols = s->cast.use_ue8m0 ? hidden / 512 : groups;
    if (r->recv_x.data == NULL || r->recv_x.ndim != 3 || r->recv_x.shape[0] != num_local ||
        r->recv_x.shape[1] != rows || r->recv_x.shape[2] != hidden ||
        r->recv_x.dtype != (fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16) ||
        r->recv_count.data == NULL || r->recv_count.shape[0] != num_local ||
        r->recv_count.dtype != EPX_DTYPE_INT32 || r->recv_src_info.data == NULL ||
        r->recv_src_info.dtype != EPX_DTYPE_INT32 || r->recv_src_info.shape[1] != rows ||
        r->recv_layout_range.data == NULL || r->recv_layout_range.dtype != EPX_DTYPE_INT64 ||
        r->recv_layout_range.shape[1] != world ||
        (fp8 && (r->recv_x_scales.data == NULL || r->recv_x_scales.ndim != 3 ||
                 r->recv_x_scales.dtype != scale_dtype || r->recv_x_scales.shape[1] != rows ||
                 r->recv_x_scales.shape[2] != scale_cols))) {
        fail(what, "dispatch result shapes: recv_x %s [%lld, %lld, %lld], scales %s [.., %lld, "
             "%lld], count %s [%lld], src_info %s [.., %lld], range %s [.., %lld]; expected "
             "L %d, rows %lld, hidden %lld", epx_dtype_name(r->recv_x.dtype),
             (long long)r->recv_x.shape[0], (long long)r->recv_x.shape[1],
             (long long)r->recv_x.shape[2], epx_dtype_name(r->recv_x_scales.dtype),
             (long long)r->recv_x_scales.shape[1], (long long)r->recv_x_scales.shape[2],
             epx_dtype_name(r->recv_count.dtype), (long long)r->recv_count.shape[0],
             epx_dtype_name(r->recv_src_info.dtype), (long long)r->recv_src_info.shape[1],
             epx_dtype_name(r->recv_layout_range.dtype), (long long)r->recv_layout_range.shape[1],
             num_local, (long long)rows, (long long)hidden);
        return;
    }
    /* GPU: -1 (no host sync). A count, where given, must be the oracle's. */
    if (r->num_masked_entries != -1 && r->num_masked_entries != e->masked_entries)
        fail(what, "num_masked_entries %lld, oracle %lld", (long long)r->num_masked_entries,
             (long long)e->masked_entries);

    int32_t *count = calloc((size_t)num_local, sizeof(int32_t));
    int64_t *range = calloc((size_t)world, sizeof(int64_t));
    int32_t *src = calloc((size_t)rows + 1, sizeof(int32_t));
    size_t x_row = (size_t)hidden * (fp8 ? 1 : 2);
    size_t scale_row = (size_t)scale_cols * 4;
    char *x = malloc((size_t)rows * x_row + 1);
    unsigned char *scales = malloc((size_t)rows * scale_row + 1);
    if (!count || !range || !src || !x || !scales)
        exit(1);
    copy_back(count, &r->recv_count, 0, 0, num_local);
    int bad_count = 0, bad_range = 0, bad_src = 0, bad_x = 0, bad_scale = 0;
    for (int local = 0; local < num_local; local++) {
        if (count[local] != e->count[local] && bad_count++ == 0)
            fail(what, "expert %d: recv_count %d, oracle %d", local, count[local],
                 e->count[local]);
        copy_back(range, &r->recv_layout_range, local, 0, world);
        for (int s_rank = 0; s_rank < world; s_rank++) {
            int64_t want = e->range[local * world + s_rank];
            if (range[s_rank] != want && bad_range++ == 0)
                fail(what, "expert %d source rank %d: layout range begin %lld count %lld, oracle "
                     "begin %lld count %lld", local, s_rank,
                     (long long)((uint64_t)range[s_rank] >> 32),
                     (long long)(range[s_rank] & 0xffffffff), (long long)((uint64_t)want >> 32),
                     (long long)(want & 0xffffffff));
        }
        int64_t n = e->count[local]; /* the oracle's rows; extra rows are a count error */
        copy_back(src, &r->recv_src_info, local, 0, n);
        copy_back(x, &r->recv_x, local, 0, n);
        if (fp8)
            copy_back(scales, &r->recv_x_scales, local, 0, n);
        for (int64_t i = 0; i < n; i++) {
            int64_t row = local * rows + i;
            if (src[i] != e->src_token[row] && bad_src++ == 0)
                fail(what, "expert %d row %lld: recv_src_info %d, oracle token %d of rank %d",
                     local, (long long)i, src[i], e->src_token[row], e->src_rank[row]);
            const unsigned char *want_x = (const unsigned char *)e->x + (size_t)row * x_row;
            const unsigned char *have_x = (const unsigned char *)x + (size_t)i * x_row;
            int64_t at = first_difference(have_x, want_x, x_row);
            if (at >= 0 && bad_x++ == 0) {
                if (fp8)
                    fail(what, "expert %d row %lld (rank %d token %d): fp8 byte %lld is 0x%02x, "
                         "oracle 0x%02x", local, (long long)i, e->src_rank[row],
                         e->src_token[row], (long long)at, have_x[at], want_x[at]);
                else
                    fail(what, "expert %d row %lld (rank %d token %d): bf16 element %lld is "
                         "0x%04x, oracle 0x%04x", local, (long long)i, e->src_rank[row],
                         e->src_token[row], (long long)(at / 2),
                         ((const uint16_t *)have_x)[at / 2], ((const uint16_t *)want_x)[at / 2]);
            }
            for (int64_t g = 0; fp8 && g < groups; g++) {
                float want = e->scales[row * groups + g];
                uint32_t bits;
                memcpy(&bits, &want, 4);
                if (s->cast.use_ue8m0) {
                    /* Exponent byte of group g: byte g % 4 of int32 g / 4 = byte g of the row. */
                    unsigned have = scales[(size_t)i * scale_row + (size_t)g];
                    if (have != ((bits >> 23) & 0xff) && bad_scale++ == 0)
                        fail(what, "expert %d row %lld group %lld: ue8m0 byte %u, oracle %u",
                             local, (long long)i, (long long)g, have, (bits >> 23) & 0xff);
                } else {
                    float have;
                    memcpy(&have, scales + (size_t)i * scale_row + (size_t)g * 4, 4);
                    if (memcmp(&have, &want, 4) != 0 && bad_scale++ == 0)
                        fail(what, "expert %d row %lld group %lld: scale %a (%g), oracle %a (%g)",
                             local, (long long)i, (long long)g, (double)have, (double)have,
                             (double)want, (double)want);
                }
            }
        }
    }
    if (bad_count + bad_range + bad_src + bad_x + bad_scale > 1)
        fail(what, "dispatch mismatches in all: %d counts, %d ranges, %d src_info, %d rows of x, "
             "%d scales", bad_count, bad_range, bad_src, bad_x, bad_scale);
    free(count);
    free(range);
    free(src);
    free(x);
    free(scales);
}

/* The combined output `out` (device; the stream is synchronised here) against the oracle. */
static void check_combine(const char *what, const step_t *s, const void *out)
{
    CUDA_OK(cudaStreamSynchronize(g_stream));
    int64_t n = s->shape.tokens * s->shape.hidden, hidden = s->shape.hidden, bad = 0, first = -1;
    uint16_t *got = malloc((size_t)n * 2 + 2);
    if (got == NULL)
        exit(1);
    CUDA_OK(cudaMemcpy(got, out, (size_t)n * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++)
        if (got[i] != s->want[i] && bad++ == 0)
            first = i;
    if (bad > 0) {
        const int64_t *idx = s->in.topk_idx + (first / hidden) * s->shape.topk;
        fail(what, "combine: %lld of %lld values differ; first at token %lld column %lld: 0x%04x, "
             "oracle 0x%04x (token's experts %lld %lld ...)", (long long)bad, (long long)n,
             (long long)(first / hidden), (long long)(first % hidden), got[first], s->want[first],
             (long long)idx[0], (long long)(s->shape.topk > 1 ? idx[1] : -1));
    }
    free(got);
}

/* No asynchronous error, and exactly the ranks of `mask` (NULL = none) masked. */
static void check_buffer_state(const char *what, epx_buffer_t buffer, const uint8_t *mask)
{
    epx_status_t error = EPX_SUCCESS;
    char message[512];
    epx_status_t status = epx_get_async_error(buffer, &error, message, sizeof(message));
    if (status != EPX_SUCCESS)
        fail(what, "epx_get_async_error: %s", epx_status_name(status));
    else if (error != EPX_SUCCESS)
        fail(what, "asynchronous error %s: %s", epx_status_name(error), message);
    int32_t masked[1024];
    if (g_world > 1024 || epx_ll_get_masked(buffer, masked, g_world) != EPX_SUCCESS) {
        fail(what, "epx_ll_get_masked: %s", epx_last_error());
        return;
    }
    for (int r = 0; r < g_world; r++)
        if (masked[r] != (mask != NULL && mask[r])) {
            fail(what, "epx_ll_get_masked: rank %d is %smasked%s", r, masked[r] ? "" : "not ",
                 masked[r] ? " (a device wait gave up on it?)" : "");
            break;
        }
}

static epx_buffer_t make_buffer(const shape_t *shape)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = shape->max_tokens;
    config.hidden = shape->hidden;
    config.num_experts = shape->experts_per_rank * g_world;
    config.num_topk = shape->topk;
    config.num_sms = g_sms;
    config.max_low_latency_tokens = shape->max_tokens;
    epx_buffer_t buffer = NULL;
    epx_status_t status = epx_buffer_create(g_group, &config, &buffer);
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_ll: rank %d: epx_buffer_create (M %lld, hidden %lld, %d experts, "
                "top-%d): %s: %s\n", g_rank, (long long)shape->max_tokens,
                (long long)shape->hidden, config.num_experts, shape->topk,
                epx_status_name(status), epx_last_error());
        exit(1);
    }
    return buffer;
}

/* ---------------------------------------------------------------- sub-tests */

static const shape_t small_shape = {16, 16, 512, 4, 4};
static int g_replays = 100, g_split_replays = 20;
static uint64_t g_seed = 1;

static void destroy_buffer(epx_buffer_t buffer, const char *what)
{
    epx_status_t status = epx_buffer_destroy(buffer);
    if (status != EPX_SUCCESS)
        fail(what, "epx_buffer_destroy: %s: %s", epx_status_name(status), epx_last_error());
}

/* Combine `x` (the zero-copy view or a tensor) and, when split, receive it. */
static epx_status_t combine_step(epx_buffer_t buffer, const io_t *io, const shape_t *shape,
                                 epx_ll_handle_t handle, epx_tensor_t x, uint32_t flags)
{
    epx_ll_combine_args_t args = combine_args(io, shape, handle, x, flags);
    epx_status_t status = epx_ll_combine(buffer, &args, NULL, g_stream);
    if (status == EPX_SUCCESS && (flags & EPX_LL_SEND_ONLY))
        status = epx_ll_receive(buffer, handle, g_stream);
    return status;
}

/* Dispatch and, when split, receive it. */
static epx_status_t dispatch_step(epx_buffer_t buffer, const io_t *io, const shape_t *shape,
                                  moe_ll_cast_t cast, uint32_t flags,
                                  epx_ll_dispatch_result_t *result)
{
    epx_ll_dispatch_args_t args = dispatch_args(io, shape, cast, flags);
    *result = (epx_ll_dispatch_result_t)EPX_LL_DISPATCH_RESULT_INIT;
    epx_status_t status = epx_ll_dispatch(buffer, &args, result, g_stream);
    if (status == EPX_SUCCESS && (flags & EPX_LL_SEND_ONLY))
        status = epx_ll_receive(buffer, result->handle, g_stream);
    return status;
}

/*
 * One step captured in a CUDA graph and replayed `replays` times with fresh inputs. The
 * captured tensors (io) stay; before each replay the step's inputs and expert outputs
 * are copied into them on the capture stream, and after it the results come back. A
 * warm-up step outside the graph comes first (as frameworks do before capturing); it
 * takes the other slot, so the graph's step always uses the same slot.
 */
static void graph_test(const char *name, moe_ll_cast_t cast, int split, int replays)
{
    const shape_t *shape = &small_shape;
    uint32_t flags = split ? EPX_LL_SEND_ONLY : 0;
    char what[160];
    epx_buffer_t buffer = make_buffer(shape);
    io_t io;
    io_alloc(&io, shape);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    int capturing = 0;
    step_t s;
    epx_ll_dispatch_result_t res;
    epx_tensor_t view;

    snprintf(what, sizeof(what), "%s: warm-up step", name);
    step_make(&s, shape, g_seed * 1000 + 999, cast, NULL);
    if (any_failure())
        goto done;
    io_upload(&io, &s);
    EPX_TRY(dispatch_step(buffer, &io, shape, cast, flags, &res), captured);
    check_dispatch(what, &s, &res);
    EPX_TRY(combine_step(buffer, &io, shape, res.handle, expert_tensor(io.y, shape), flags),
            captured);
    check_combine(what, &s, io.out);
    check_buffer_state(what, buffer, NULL);

    /* dispatch [receive], copy into the combine buffer, combine [receive] */
    snprintf(what, sizeof(what), "%s: capture", name);
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
    capturing = 1;
    EPX_TRY(dispatch_step(buffer, &io, shape, cast, flags, &res), captured);
    if (combine_view(buffer, res.handle, shape, what, &view) != 0)
        goto captured;
    CUDA_OK(cudaMemcpyAsync(view.data, io.y, io.y_bytes, cudaMemcpyDeviceToDevice, g_stream));
    EPX_TRY(combine_step(buffer, &io, shape, res.handle, view, flags), captured);
    capturing = 0;
    CUDA_OK(cudaStreamEndCapture(g_stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
captured:
    if (capturing) {
        /* End the broken capture so that the stream is usable again. */
        cudaGraph_t broken = NULL;
        cudaStreamEndCapture(g_stream, &broken);
        if (broken != NULL)
            cudaGraphDestroy(broken);
        cudaGetLastError();
    }
    CUDA_OK(cudaStreamSynchronize(g_stream));
    step_free(&s);

    for (int replay = 0; replay < replays; replay++) {
        snprintf(what, sizeof(what), "%s: replay %d of %d", name, replay + 1, replays);
        step_make(&s, shape, g_seed * 1000 + (uint64_t)replay, cast, NULL);
        if (any_failure())
            break;
        io_upload(&io, &s);
        CUDA_OK(cudaGraphLaunch(exec, g_stream));
        check_dispatch(what, &s, &res);
        check_combine(what, &s, io.out);
        check_buffer_state(what, buffer, NULL);
        step_free(&s);
    }
done:
    CUDA_OK(cudaStreamSynchronize(g_stream));
    step_free(&s);
    if (exec != NULL)
        CUDA_OK(cudaGraphExecDestroy(exec));
    if (graph != NULL)
        CUDA_OK(cudaGraphDestroy(graph));
    io_free(&io);
    destroy_buffer(buffer, name);
}

static void test_graph_fp8(void)
{
    moe_ll_cast_t fp8 = {1, 0, 0};
    graph_test("graph fp8", fp8, 0, g_replays);
}

static void test_graph_split(void)
{
    moe_ll_cast_t fp8 = {1, 0, 0};
    graph_test("graph fp8 split", fp8, 1, g_split_replays);
}

static void test_graph_bf16(void)
{
    moe_ll_cast_t bf16 = {0, 0, 0};
    graph_test("graph bf16", bf16, 0, 3);
}

/*
 * Two steps in flight outside graphs: dispatch A and B (send-only), receive A and B,
 * combine A through the zero-copy buffer and B from a separate tensor: blocking in round
 * 0; in later rounds both combines send-only (one operation in flight per slot), then
 * received in order. Every round reuses both slots.
 */
static void test_overlap(void)
{
    const shape_t *shape = &small_shape;
    moe_ll_cast_t fp8 = {1, 0, 0}, bf16 = {0, 0, 0};
    epx_buffer_t buffer = make_buffer(shape);
    io_t io_a, io_b;
    io_alloc(&io_a, shape);
    io_alloc(&io_b, shape);
    step_t a, b;
    char what_a[96], what_b[96];
    for (int round = 0; round < 3; round++) {
        uint32_t combine_flags = round == 0 ? 0 : EPX_LL_SEND_ONLY;
        snprintf(what_a, sizeof(what_a), "overlap round %d, step A (fp8)", round);
        snprintf(what_b, sizeof(what_b), "overlap round %d, step B (bf16)", round);
        step_make(&a, shape, g_seed * 2000 + (uint64_t)round * 2, fp8, NULL);
        step_make(&b, shape, g_seed * 2000 + (uint64_t)round * 2 + 1, bf16, NULL);
        if (any_failure()) {
            step_free(&a);
            step_free(&b);
            break;
        }
        io_upload(&io_a, &a);
        io_upload(&io_b, &b);
        epx_ll_dispatch_args_t args_a = dispatch_args(&io_a, shape, fp8, EPX_LL_SEND_ONLY);
        epx_ll_dispatch_args_t args_b = dispatch_args(&io_b, shape, bf16, EPX_LL_SEND_ONLY);
        epx_ll_dispatch_result_t res_a = EPX_LL_DISPATCH_RESULT_INIT;
        epx_ll_dispatch_result_t res_b = EPX_LL_DISPATCH_RESULT_INIT;
        epx_tensor_t view;
        EPX_TRY(epx_ll_dispatch(buffer, &args_a, &res_a, g_stream), next_round);
        EPX_TRY(epx_ll_dispatch(buffer, &args_b, &res_b, g_stream), next_round);
        EPX_TRY(epx_ll_receive(buffer, res_a.handle, g_stream), next_round);
        EPX_TRY(epx_ll_receive(buffer, res_b.handle, g_stream), next_round);
        check_dispatch(what_a, &a, &res_a);
        check_dispatch(what_b, &b, &res_b);

        if (combine_view(buffer, res_a.handle, shape, what_a, &view) != 0)
            goto next_round;
        CUDA_OK(cudaMemcpyAsync(view.data, io_a.y, io_a.y_bytes, cudaMemcpyDeviceToDevice,
                                g_stream));
        epx_ll_combine_args_t comb_a = combine_args(&io_a, shape, res_a.handle, view,
                                                    combine_flags);
        epx_ll_combine_args_t comb_b = combine_args(&io_b, shape, res_b.handle,
                                                    expert_tensor(io_b.y, shape), combine_flags);
        EPX_TRY(epx_ll_combine(buffer, &comb_a, NULL, g_stream), next_round);
        EPX_TRY(epx_ll_combine(buffer, &comb_b, NULL, g_stream), next_round);
        if (combine_flags & EPX_LL_SEND_ONLY) {
            EPX_TRY(epx_ll_receive(buffer, res_a.handle, g_stream), next_round);
            EPX_TRY(epx_ll_receive(buffer, res_b.handle, g_stream), next_round);
        }
        check_combine(what_a, &a, io_a.out);
        check_combine(what_b, &b, io_b.out);
        check_buffer_state(what_b, buffer, NULL);
    next_round:
        CUDA_OK(cudaStreamSynchronize(g_stream)); /* the copies from a and b are done */
        step_free(&a);
        step_free(&b);
    }
    CUDA_OK(cudaStreamSynchronize(g_stream));
    io_free(&io_a);
    io_free(&io_b);
    destroy_buffer(buffer, "overlap");
}

/*
 * Rank `lost` sits the steps out (as a failed peer would); every other rank masks it
 * first. Its rows are absent from the dispatch and its experts combine as zeros, as the
 * oracle with the mask says. The lost rank joins only the host meetings between steps.
 */
static void test_masked(void)
{
    const shape_t *shape = &small_shape;
    int lost = g_world / 2, alive = g_rank != lost;
    uint8_t *mask = calloc((size_t)g_world, 1);
    if (mask == NULL)
        exit(1);
    mask[lost] = 1;
    moe_ll_cast_t casts[3] = {{1, 0, 0}, {1, 1, 1}, {0, 0, 0}};
    epx_buffer_t buffer = make_buffer(shape);
    io_t io;
    io_alloc(&io, shape);
    step_t s;
    char what[96];
    if (alive) {
        check_buffer_state("masked rank: before masking", buffer, NULL);
        EPX_TRY(epx_ll_mask_rank(buffer, lost), steps);
        check_buffer_state("masked rank: after epx_ll_mask_rank", buffer, mask);
    }
steps:
    for (int step = 0; step < 3; step++) {
        /* Step 1 splits dispatch and combine; step 2 combines from a separate tensor. */
        uint32_t flags = step == 1 ? EPX_LL_SEND_ONLY : 0;
        snprintf(what, sizeof(what), "masked rank %d: step %d (%s%s)", lost, step,
                 casts[step].use_fp8 ? (casts[step].use_ue8m0 ? "fp8 ue8m0" : "fp8") : "bf16",
                 flags ? ", split" : "");
        memset(&s, 0, sizeof(s));
        if (alive)
            step_make(&s, shape, g_seed * 3000 + (uint64_t)step, casts[step], mask);
        if (any_failure()) {
            step_free(&s);
            break;
        }
        if (!alive)
            continue;
        io_upload(&io, &s);
        epx_ll_dispatch_result_t res;
        epx_tensor_t x = expert_tensor(io.y, shape);
        EPX_TRY(dispatch_step(buffer, &io, shape, casts[step], flags, &res), next_step);
        check_dispatch(what, &s, &res);
        if (step != 2) {
            if (combine_view(buffer, res.handle, shape, what, &x) != 0)
                goto next_step;
            CUDA_OK(cudaMemcpyAsync(x.data, io.y, io.y_bytes, cudaMemcpyDeviceToDevice,
                                    g_stream));
        }
        EPX_TRY(combine_step(buffer, &io, shape, res.handle, x, flags), next_step);
        check_combine(what, &s, io.out);
        check_buffer_state(what, buffer, mask);
    next_step:
        CUDA_OK(cudaStreamSynchronize(g_stream));
        step_free(&s);
    }
    CUDA_OK(cudaStreamSynchronize(g_stream));
    io_free(&io);
    destroy_buffer(buffer, "masked rank");
    free(mask);
}

/* DESIGN.md section 5's low-latency case, fp8, checked once (the oracle takes a while). */
static void test_standard(void)
{
    shape_t shape = {128, 128, 7168, 256 / g_world, 8};
    moe_ll_cast_t fp8 = {1, 0, 0};
    const char *what = "standard case";
    epx_buffer_t buffer = make_buffer(&shape);
    io_t io;
    memset(&io, 0, sizeof(io));
    /* No y staging tensor: the expert outputs go straight into the combine buffer. */
    int64_t t = shape.tokens, h = shape.hidden, k = shape.topk;
    io.x_bytes = (size_t)(t * h) * 2;
    io.idx_bytes = (size_t)(t * k) * 8;
    io.weights_bytes = (size_t)(t * k) * 4;
    io.out_bytes = (size_t)(t * h) * 2;
    io.x = device_alloc(io.x_bytes);
    io.idx = device_alloc(io.idx_bytes);
    io.weights = device_alloc(io.weights_bytes);
    io.out = device_alloc(io.out_bytes);
    step_t s;
    epx_ll_dispatch_result_t res;
    epx_tensor_t view;
    step_make(&s, &shape, g_seed * 4000, fp8, NULL);
    if (any_failure())
        goto done;
    CUDA_OK(cudaMemcpyAsync(io.x, s.in.x, io.x_bytes, cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaMemcpyAsync(io.idx, s.in.topk_idx, io.idx_bytes, cudaMemcpyHostToDevice,
                            g_stream));
    CUDA_OK(cudaMemcpyAsync(io.weights, s.in.topk_weights, io.weights_bytes,
                            cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaMemsetAsync(io.out, 0xff, io.out_bytes, g_stream));
    EPX_TRY(dispatch_step(buffer, &io, &shape, fp8, 0, &res), done);
    check_dispatch(what, &s, &res);
    if (combine_view(buffer, res.handle, &shape, what, &view) != 0)
        goto done;
    upload_expert_outputs(view.data, &s);
    EPX_TRY(combine_step(buffer, &io, &shape, res.handle, view, 0), done);
    check_combine(what, &s, io.out);
    check_buffer_state(what, buffer, NULL);
done:
    CUDA_OK(cudaStreamSynchronize(g_stream));
    step_free(&s);
    io_free(&io);
    destroy_buffer(buffer, what);
}

/* ---------------------------------------------------------------- main */

typedef struct {
    const char *name;
    void (*run)(void);
    int runnable; /* else SKIP, with `why` */
    const char *why;
} subtest_t;

int main(int argc, char **argv)
{
    epx_status_t status = epx_group_create_from_env(EPX_BACKEND_CUDA, &g_group);
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_ll: group: %s: %s\n", epx_status_name(status), epx_last_error());
        return 1;
    }
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    if (epx_group_get_info(g_group, &info) != EPX_SUCCESS)
        return 1;
    g_rank = info.rank;
    g_world = info.world_size;
    CUDA_OK(cudaSetDevice(info.device));
    CUDA_OK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    g_sms = (int)flag_value(argc, argv, "--sms", 16);
    g_replays = (int)flag_value(argc, argv, "--replays", 100);
    g_split_replays = (int)flag_value(argc, argv, "--split-replays", 20);
    g_seed = (uint64_t)flag_value(argc, argv, "--seed", 1);
    unsigned watchdog_s = (unsigned)flag_value(argc, argv, "--watchdog", 300);
    const char *only = flag_text(argc, argv, "--only", "");
    signal(SIGALRM, on_watchdog);

    char graph_name[64], split_name[64], standard_name[80];
    snprintf(graph_name, sizeof(graph_name), "graph fp8, %d replays", g_replays);
    snprintf(split_name, sizeof(split_name), "graph fp8 send-only + receive, %d replays",
             g_split_replays);
    snprintf(standard_name, sizeof(standard_name),
             "standard case (128 x 7168, 256 experts, top-8, fp8)");
    const subtest_t subtests[] = {
        {graph_name, test_graph_fp8, 1, ""},
        {split_name, test_graph_split, 1, ""},
        {"graph bf16, 3 replays", test_graph_bf16, 1, ""},
        {"overlap: two steps in flight, send/receive split", test_overlap, 1, ""},
        {"masked rank", test_masked, g_world >= 4, "needs 4 or more ranks"},
        {standard_name, test_standard, 256 % g_world == 0, "256 experts need R | 256"},
    };
    if (g_rank == 0)
        printf("cuda_ll: %d ranks on device %d, %d SMs per rank, EPX_TIMEOUT_MS=%s\n", g_world,
               info.device, g_sms, getenv("EPX_TIMEOUT_MS") ? getenv("EPX_TIMEOUT_MS") : "default");
    int failed_subtests = 0;
    int *failed_ranks = calloc((size_t)g_world, sizeof(int));
    for (size_t i = 0; i < sizeof(subtests) / sizeof(subtests[0]); i++) {
        const subtest_t *t = &subtests[i];
        if (only[0] != '\0' && strstr(t->name, only) == NULL)
            continue;
        if (!t->runnable) {
            if (g_rank == 0)
                printf("SKIP %s: %s\n", t->name, t->why);
            continue;
        }
        double start = now_s();
        g_subtest_base = g_failures;
        watchdog_arm(t->name, watchdog_s);
        t->run();
        alarm(0);
        int n_failed = 0;
        int total = sum_over_ranks(g_failures - g_subtest_base, failed_ranks, &n_failed);
        if (total > 0)
            failed_subtests++;
        if (g_rank == 0) {
            if (total == 0) {
                printf("PASS %s (%.1f s)\n", t->name, now_s() - start);
            } else {
                printf("FAIL %s: %d failed check(s) on rank(s)", t->name, total);
                for (int r = 0; r < n_failed; r++)
                    printf(" %d", failed_ranks[r]);
                printf(" (their messages are on stderr)\n");
            }
            fflush(stdout);
        }
    }
    free(failed_ranks);
    if (g_rank == 0) {
        printf("cuda_ll: %s\n", failed_subtests ? "FAILED" : "all sub-tests passed");
        fflush(stdout);
    }
    /* Nobody exits (and so gets the launcher to stop the others) before rank 0 printed. */
    sum_over_ranks(0, NULL, NULL);
    cudaStreamDestroy(g_stream);
    epx_group_destroy(g_group);
    return failed_subtests ? 1 : 0;
}
