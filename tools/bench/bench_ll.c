/*
 * `epx bench --mode ll`: the low-latency ops of include/epx.h (docs/LOW_LATENCY.md) on
 * the standard decode case of DESIGN.md section 5, in the manner of the normal mode
 * (bench_case.c): inputs from the seed, a first step run once and checked against the
 * oracle (tests/common/moe_ll.c) with --check, then timed iterations.
 *
 * An iteration is two low-latency steps, one per slot of the buffer:
 *   1. the whole calls: epx_ll_dispatch, then epx_ll_combine with x in the step's
 *      zero-copy combine buffer (epx_ll_get_combine_buffer), back to back;
 *   2. the split: epx_ll_dispatch with EPX_LL_SEND_ONLY, then epx_ll_receive; the same
 *      for combine. Each half is timed alone, and every rank's send has finished before
 *      any receive starts (its wait for the stream, then a barrier), which is the case
 *      the split is for: compute covered the transfer, so the receive only lands it.
 * Every phase starts after a barrier, so the ranks start together. Times come from the
 * bench's timestamps (bench_memory.h): CUDA events on the bench stream for the CUDA
 * backend, the wall clock for the host backend.
 *
 * The expert outputs are written into each slot's combine buffer once, in the first
 * step: every step has the same inputs, so it receives the same rows in the same order,
 * and no operation writes that memory. A combine buffer at an address not seen before
 * is filled again (outside the timed calls).
 *
 * Every rank runs the same sequence of collective calls whatever its check found, so a
 * wrong result on one rank is reported, never turned into a hang on the others.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* What every rank tells the others after the timed iterations. */
typedef struct {
    int64_t sent_rows;
    int64_t recv_rows;
    int64_t tokens;
    int32_t check[EPX__BENCH_LL_OP_COUNT];
} rank_summary_t;

static int is_fp8(const ll_case_t *lc)
{
    return lc->cast.use_fp8;
}

static void *host_alloc(const ll_case_t *lc, size_t bytes, const char *what)
{
    void *memory = calloc(1, bytes > 0 ? bytes : 1);
    if (memory == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory (%s)\n", lc->rank, what);
        exit(1);
    }
    return memory;
}

/* ---------------------------------------------------------------- ops */

static epx_ll_dispatch_result_t run_dispatch(ll_case_t *lc, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(lc->x, EPX_DTYPE_BF16, lc->inputs.num_tokens, lc->moe.hidden);
    args.topk_idx =
        epx_tensor_2d(lc->topk_idx, EPX_DTYPE_INT64, lc->inputs.num_tokens, lc->moe.num_topk);
    args.use_fp8 = lc->cast.use_fp8;
    args.round_scale = lc->cast.round_scale;
    args.use_ue8m0 = lc->cast.use_ue8m0;
    args.flags = flags;
    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    epx__bench_must(lc->rank, epx_ll_dispatch(lc->buffer, &args, &result, lc->device->stream),
                    flags & EPX_LL_SEND_ONLY ? "epx_ll_dispatch (EPX_LL_SEND_ONLY)"
                                             : "epx_ll_dispatch");
    return result;
}

static void run_receive(ll_case_t *lc, epx_ll_handle_t handle, const char *what)
{
    epx__bench_must(lc->rank, epx_ll_receive(lc->buffer, handle, lc->device->stream), what);
}

static void run_combine(ll_case_t *lc, epx_ll_handle_t handle, const epx_tensor_t *x,
                        uint32_t flags)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = *x;
    args.topk_idx =
        epx_tensor_2d(lc->topk_idx, EPX_DTYPE_INT64, lc->inputs.num_tokens, lc->moe.num_topk);
    args.topk_weights =
        epx_tensor_2d(lc->topk_weights, EPX_DTYPE_FP32, lc->inputs.num_tokens, lc->moe.num_topk);
    args.out = epx_tensor_2d(lc->out, EPX_DTYPE_BF16, lc->inputs.num_tokens, lc->moe.hidden);
    args.flags = flags;
    epx__bench_must(lc->rank, epx_ll_combine(lc->buffer, &args, NULL, lc->device->stream),
                    flags & EPX_LL_SEND_ONLY ? "epx_ll_combine (EPX_LL_SEND_ONLY)"
                                             : "epx_ll_combine");
}

/*
 * The step's zero-copy combine input, holding the expert outputs: a contiguous bf16
 * [L, M * R, hidden] view, expert l's received rows at its start.
 */
static epx_tensor_t combine_input(ll_case_t *lc, epx_ll_handle_t handle)
{
    epx_tensor_t view = EPX_TENSOR_NONE;
    epx__bench_must(lc->rank, epx_ll_get_combine_buffer(lc->buffer, handle, &view),
                    "epx_ll_get_combine_buffer");
    if (view.data == lc->filled[0] || view.data == lc->filled[1])
        return view;
    if (view.ndim != 3 || view.dtype != EPX_DTYPE_BF16 || view.shape[0] != lc->num_local ||
        view.shape[1] != lc->rows || view.shape[2] != lc->moe.hidden) {
        fprintf(stderr, "epx bench: %s: the combine buffer is a %s view of %d dims, expected "
                        "bf16 [%d, %lld, %lld]\n",
                lc->label, epx_dtype_name(view.dtype), view.ndim, lc->num_local,
                (long long)lc->rows, (long long)lc->moe.hidden);
        exit(1);
    }
    size_t row_bytes = (size_t)lc->moe.hidden * 2;
    for (int l = 0; l < lc->num_local; l++) {
        char *expert = (char *)view.data + (size_t)l * (size_t)lc->rows * row_bytes;
        epx__bench_must(lc->rank,
                        epx__bench_copy_in(lc->device, expert,
                                           lc->expert_out + lc->expert_first[l] * lc->moe.hidden,
                                           (size_t)lc->recv_count[l] * row_bytes),
                        "bench copy into the combine buffer");
    }
    if (lc->filled[0] == NULL)
        lc->filled[0] = view.data;
    else
        lc->filled[1] = view.data;
    return view;
}

/* ---------------------------------------------------------------- results */

/* Elements between consecutive indices of dimension `dim` (the strides, or row major). */
static int64_t stride_of(const epx_tensor_t *t, int dim)
{
    if (t->strides[dim] != 0)
        return t->strides[dim];
    int64_t stride = 1;
    for (int d = dim + 1; d < t->ndim; d++)
        stride *= t->shape[d];
    return stride;
}

/*
 * `rows` rows of `row_elements` elements of a result (maybe device memory), the first
 * at element `offset`, rows `pitch` elements apart, to a new host array.
 */
static void *copy_out(ll_case_t *lc, const epx_tensor_t *t, int64_t offset, int64_t rows,
                      int64_t row_elements, int64_t pitch)
{
    size_t element = epx_dtype_size(t->dtype);
    size_t row_bytes = (size_t)row_elements * element;
    void *host = host_alloc(lc, (size_t)rows * row_bytes, "copying results");
    epx__bench_must(lc->rank,
                    epx__bench_copy_rows_out(lc->device, host,
                                             (const char *)t->data + (size_t)offset * element,
                                             rows, row_bytes, (size_t)pitch * element),
                    "bench copy of results");
    return host;
}

/* Expert l's first `rows` rows of a [L, M * R, cols] or [L, M * R] result. */
static void *copy_expert(ll_case_t *lc, const epx_tensor_t *t, int l, int64_t rows)
{
    int64_t first = (int64_t)l * stride_of(t, 0);
    if (t->ndim == 2)
        return copy_out(lc, t, first, 1, rows, rows);
    return copy_out(lc, t, first, rows, t->shape[2], stride_of(t, 1));
}

static int check_shape(const ll_case_t *lc, const char *what, const epx_tensor_t *t,
                       epx_dtype_t dtype, int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    const int64_t want[3] = {d0, d1, d2};
    int ok = t->data != NULL && t->dtype == dtype && t->ndim == ndim;
    for (int d = 0; d < ndim && ok; d++)
        ok = t->shape[d] == want[d];
    if (!ok)
        fprintf(stderr, "epx bench: %s: %s is %s [%lld, %lld, %lld] (%d dims), expected %s "
                        "[%lld, %lld, %lld] (%d dims)\n",
                lc->label, what, epx_dtype_name(t->dtype), (long long)t->shape[0],
                (long long)t->shape[1], (long long)t->shape[2], t->ndim, epx_dtype_name(dtype),
                (long long)d0, (long long)d1, (long long)d2, ndim);
    return ok;
}

static int check_result_shapes(const ll_case_t *lc, const char *op,
                               const epx_ll_dispatch_result_t *r)
{
    char what[96];
    int64_t hidden = lc->moe.hidden;
    snprintf(what, sizeof(what), "%s recv_x", op);
    int ok = check_shape(lc, what, &r->recv_x, is_fp8(lc) ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16,
                         3, lc->num_local, lc->rows, hidden);
    if (is_fp8(lc)) {
        snprintf(what, sizeof(what), "%s recv_x_scales", op);
        ok &= lc->cast.use_ue8m0 ? check_shape(lc, what, &r->recv_x_scales, EPX_DTYPE_INT32, 3,
                                               lc->num_local, lc->rows, hidden / 512)
                                 : check_shape(lc, what, &r->recv_x_scales, EPX_DTYPE_FP32, 3,
                                               lc->num_local, lc->rows, hidden / 128);
    }
    snprintf(what, sizeof(what), "%s recv_count", op);
    ok &= check_shape(lc, what, &r->recv_count, EPX_DTYPE_INT32, 1, lc->num_local, 0, 0);
    snprintf(what, sizeof(what), "%s recv_src_info", op);
    ok &= check_shape(lc, what, &r->recv_src_info, EPX_DTYPE_INT32, 2, lc->num_local, lc->rows, 0);
    snprintf(what, sizeof(what), "%s recv_layout_range", op);
    ok &= check_shape(lc, what, &r->recv_layout_range, EPX_DTYPE_INT64, 2, lc->num_local,
                      lc->world_size, 0);
    return ok;
}

/*
 * From the first step's results: the rows received per expert, and the expert outputs
 * combine sends back (moe_ll_expert_row of each received row's source token). Ranges
 * that do not fit the counts are skipped and remembered (layout_ok), which fails the
 * dispatch check; without --check they just leave rows unfilled.
 */
static void learn_layout(ll_case_t *lc, const epx_ll_dispatch_result_t *r)
{
    if (!check_result_shapes(lc, "dispatch", r)) {
        fprintf(stderr, "epx bench: %s: epx_ll_dispatch returned results of the wrong shape\n",
                lc->label);
        exit(1);
    }
    int world = lc->world_size, num_local = lc->num_local;
    int64_t hidden = lc->moe.hidden;
    int32_t *count = copy_out(lc, &r->recv_count, 0, 1, num_local, num_local);
    int64_t *range = copy_out(lc, &r->recv_layout_range, 0, num_local, world,
                              stride_of(&r->recv_layout_range, 0));
    lc->layout_ok = 1;
    lc->recv_rows = 0;
    lc->recv_count = host_alloc(lc, (size_t)num_local * sizeof(int32_t), "counts");
    lc->expert_first = host_alloc(lc, (size_t)num_local * sizeof(int64_t), "counts");
    for (int l = 0; l < num_local; l++) {
        if (count[l] < 0 || count[l] > lc->rows) {
            lc->layout_ok = 0;
            count[l] = count[l] < 0 ? 0 : (int32_t)lc->rows;
        }
        lc->recv_count[l] = count[l];
        lc->expert_first[l] = lc->recv_rows;
        lc->recv_rows += count[l];
    }
    lc->expert_out =
        host_alloc(lc, (size_t)lc->recv_rows * (size_t)hidden * 2, "the expert outputs");
    for (int l = 0; l < num_local; l++) {
        if (count[l] == 0)
            continue;
        int32_t *src_token = copy_expert(lc, &r->recv_src_info, l, count[l]);
        int64_t covered = 0;
        for (int s = 0; s < world; s++) {
            uint64_t packed = (uint64_t)range[(size_t)l * (size_t)world + (size_t)s];
            int64_t begin = (int64_t)(packed >> 32), n = (int64_t)(packed & 0xffffffffu);
            if (begin + n > count[l]) {
                lc->layout_ok = 0;
                continue;
            }
            covered += n;
            for (int64_t i = begin; i < begin + n; i++)
                moe_ll_expert_row(&lc->moe, (int64_t)lc->rank * num_local + l, s, src_token[i],
                                  lc->expert_out + (lc->expert_first[l] + i) * hidden);
        }
        lc->layout_ok &= covered == count[l];
        free(src_token);
    }
    free(count);
    free(range);
}

/* Compare one expert's rows; on a difference name the expert (rows count within it). */
static int compare_expert(const ll_case_t *lc, const char *op, const char *tensor, int l,
                          epx_dtype_t dtype, const void *got, const void *expected, int64_t rows,
                          int64_t cols)
{
    char what[128];
    snprintf(what, sizeof(what), "%s %s of local expert %d", op, tensor, l);
    return epx__bench_compare(lc->label, what, dtype, got, expected, rows, cols);
}

/* The UE8M0 bytes of the oracle's power-of-two scales: the fp32 exponent field. */
static uint8_t *ue8m0_bytes(const ll_case_t *lc, const float *scales, int64_t count)
{
    uint8_t *bytes = host_alloc(lc, (size_t)count, "expected scales");
    for (int64_t i = 0; i < count; i++) {
        uint32_t bits;
        memcpy(&bits, &scales[i], sizeof(bits));
        bytes[i] = (uint8_t)((bits >> 23) & 0xffu);
    }
    return bytes;
}

/* Expert l's rows of recv_x, its scales and its source tokens against the oracle. */
static int check_expert(ll_case_t *lc, const char *op, const moe_ll_expected_t *e,
                        const epx_ll_dispatch_result_t *r, int l)
{
    int64_t n = e->count[l], hidden = lc->moe.hidden, groups = hidden / 128;
    int64_t first = (int64_t)l * e->rows; /* in the oracle's [L][rows] arrays */
    if (n == 0)
        return 1;
    int32_t *src = copy_expert(lc, &r->recv_src_info, l, n);
    int ok = compare_expert(lc, op, "recv_src_info", l, EPX_DTYPE_INT32, src,
                            e->src_token + first, 1, n);
    free(src);
    epx_dtype_t x_dtype = is_fp8(lc) ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    void *x = copy_expert(lc, &r->recv_x, l, n);
    ok = ok && compare_expert(lc, op, "recv_x", l, x_dtype, x,
                              (const char *)e->x + (size_t)first * (size_t)hidden *
                                                       epx_dtype_size(x_dtype),
                              n, hidden);
    free(x);
    if (!ok || !is_fp8(lc))
        return ok;
    void *scales = copy_expert(lc, &r->recv_x_scales, l, n);
    if (lc->cast.use_ue8m0) {
        /* Four exponent bytes per int32, channel group g in byte g % 4 of word g / 4:
         * in memory, byte g of the row. */
        uint8_t *want = ue8m0_bytes(lc, e->scales + first * groups, n * groups);
        ok = compare_expert(lc, op, "recv_x_scales (UE8M0 bytes)", l, EPX_DTYPE_FP8_E4M3,
                            scales, want, n, groups);
        free(want);
    } else {
        ok = compare_expert(lc, op, "recv_x_scales", l, EPX_DTYPE_FP32, scales,
                            e->scales + first * groups, n, groups);
    }
    free(scales);
    return ok;
}

/* A dispatch's results against the oracle: counts, ranges, then each expert's rows. */
static int check_dispatch(ll_case_t *lc, const char *op, const moe_ll_expected_t *e,
                          const epx_ll_dispatch_result_t *r)
{
    if (!check_result_shapes(lc, op, r))
        return 0;
    int world = lc->world_size, num_local = lc->num_local;
    char what[96];
    int32_t *count = copy_out(lc, &r->recv_count, 0, 1, num_local, num_local);
    snprintf(what, sizeof(what), "%s recv_count", op);
    int ok = epx__bench_compare(lc->label, what, EPX_DTYPE_INT32, count, e->count, 1, num_local);
    free(count);
    if (!ok)
        return 0; /* the rows would differ everywhere after the first wrong count */
    int64_t *range = copy_out(lc, &r->recv_layout_range, 0, num_local, world,
                              stride_of(&r->recv_layout_range, 0));
    snprintf(what, sizeof(what), "%s recv_layout_range", op);
    ok = epx__bench_compare(lc->label, what, EPX_DTYPE_INT64, range, e->range, num_local, world);
    free(range);
    for (int l = 0; l < num_local && ok; l++)
        ok = check_expert(lc, op, e, r, l);
    if (ok && !lc->layout_ok) {
        fprintf(stderr, "epx bench: %s: the first dispatch's ranges do not fit its counts\n",
                lc->label);
        ok = 0;
    }
    return ok;
}

static void clear_out(ll_case_t *lc)
{
    size_t bytes = (size_t)lc->inputs.num_tokens * (size_t)lc->moe.hidden * 2;
    epx__bench_must(lc->rank, epx__bench_fill(lc->device, lc->out, 0xff, bytes),
                    "bench clearing out");
}

static int check_combine(ll_case_t *lc, const char *what, const uint16_t *expected)
{
    epx_tensor_t out = epx_tensor_2d(lc->out, EPX_DTYPE_BF16, lc->inputs.num_tokens, lc->moe.hidden);
    uint16_t *got = copy_out(lc, &out, 0, lc->inputs.num_tokens, lc->moe.hidden, lc->moe.hidden);
    /* The GPU backend sums in the oracle's order with the same fp32 operations: exact. */
    int ok = epx__bench_compare(lc->label, what, EPX_DTYPE_BF16, got, expected,
                                lc->inputs.num_tokens, lc->moe.hidden);
    free(got);
    return ok;
}

/* ---------------------------------------------------------------- the first step */

/* Both phases once, untimed; with --check every result against the oracle. */
static void run_first(ll_case_t *lc, int32_t check[EPX__BENCH_LL_OP_COUNT])
{
    int checking = lc->options->check;
    moe_ll_expected_t expected;
    uint16_t *expected_out = NULL;
    memset(&expected, 0, sizeof(expected));
    if (checking) {
        int64_t masked = 0;
        if (moe_ll_oracle_dispatch(&lc->moe, lc->rank, lc->moe.num_tokens, NULL, lc->cast,
                                   &expected) != 0 ||
            moe_ll_oracle_combine(&lc->moe, lc->rank, NULL, &expected_out, &masked) != 0) {
            fprintf(stderr, "epx bench: rank %d: out of memory in the oracle\n", lc->rank);
            exit(1);
        }
    }
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++)
        check[op] = checking ? EPX__BENCH_CHECK_PASS : EPX__BENCH_CHECK_NONE;

    /* The whole calls. */
    epx_ll_dispatch_result_t whole = run_dispatch(lc, 0);
    learn_layout(lc, &whole);
    if (checking && !check_dispatch(lc, "dispatch", &expected, &whole))
        check[EPX__BENCH_LL_DISPATCH] = EPX__BENCH_CHECK_FAIL;
    epx_tensor_t x = combine_input(lc, whole.handle);
    clear_out(lc); /* so that no check can pass on an earlier result */
    run_combine(lc, whole.handle, &x, 0);
    if (checking && !check_combine(lc, "combine out", expected_out))
        check[EPX__BENCH_LL_COMBINE] = EPX__BENCH_CHECK_FAIL;

    /* The split, into the other slot. */
    epx_ll_dispatch_result_t split = run_dispatch(lc, EPX_LL_SEND_ONLY);
    run_receive(lc, split.handle, "epx_ll_receive (dispatch)");
    if (checking && !check_dispatch(lc, "dispatch (send + receive)", &expected, &split))
        check[EPX__BENCH_LL_DISPATCH_SEND] = check[EPX__BENCH_LL_DISPATCH_RECV] =
            EPX__BENCH_CHECK_FAIL;
    x = combine_input(lc, split.handle);
    clear_out(lc);
    run_combine(lc, split.handle, &x, EPX_LL_SEND_ONLY);
    run_receive(lc, split.handle, "epx_ll_receive (combine)");
    if (checking && !check_combine(lc, "combine (send + receive) out", expected_out))
        check[EPX__BENCH_LL_COMBINE_SEND] = check[EPX__BENCH_LL_COMBINE_RECV] =
            EPX__BENCH_CHECK_FAIL;

    /* The loops are checked by their last step's output (time_steps). */
    check[EPX__BENCH_LL_LOOP_DISPATCH] = check[EPX__BENCH_LL_DISPATCH];
    check[EPX__BENCH_LL_LOOP_COMBINE] = check[EPX__BENCH_LL_COMBINE];
    check[EPX__BENCH_LL_LOOP_STEP] = check[EPX__BENCH_LL_LOOP_SPLIT] =
        check[EPX__BENCH_LL_GRAPH_STEP] =
        check[EPX__BENCH_LL_DISPATCH] == EPX__BENCH_CHECK_FAIL ? EPX__BENCH_CHECK_FAIL
                                                               : check[EPX__BENCH_LL_COMBINE];
    if (checking)
        moe_ll_expected_free(&expected);
    lc->expected_out = expected_out;
}

/* ---------------------------------------------------------------- timing */

static void barrier(ll_case_t *lc)
{
    epx__bench_must(lc->rank, epx_group_barrier(lc->group), "epx_group_barrier");
}

static void mark(ll_case_t *lc, int index)
{
    epx__bench_must(lc->rank, epx__bench_mark(lc->device, index), "timestamp");
}

/* Waits for the stream (CUDA), so a barrier after it means every rank's work is done. */
static void read_marks(ll_case_t *lc, int marks, double *durations_us)
{
    epx__bench_must(lc->rank, epx__bench_elapsed_us(lc->device, marks, durations_us),
                    "reading timestamps");
}

/* Steps per timed loop (two timestamps each, one more at the end). */
#define LOOP_STEPS 16

/*
 * Steps back to back, `warmup` + `iters` of each kind, in loops of LOOP_STEPS after one
 * barrier: per-op times of plain steps, then whole steps with the split.
 */
static void time_loops(ll_case_t *lc, int warmup, int iters,
                       double *times[EPX__BENCH_LL_OP_COUNT])
{
    double d[2 * LOOP_STEPS];
    for (int done = -warmup; done < iters; done += LOOP_STEPS) {
        barrier(lc);
        for (int i = 0; i < LOOP_STEPS; i++) {
            mark(lc, 2 * i);
            epx_ll_dispatch_result_t step = run_dispatch(lc, 0);
            mark(lc, 2 * i + 1);
            epx_tensor_t x = combine_input(lc, step.handle);
            run_combine(lc, step.handle, &x, 0);
        }
        mark(lc, 2 * LOOP_STEPS);
        read_marks(lc, 2 * LOOP_STEPS + 1, d);
        for (int i = 0; i < LOOP_STEPS; i++) {
            int sample = done + i;
            if (sample < 0 || sample >= iters)
                continue;
            times[EPX__BENCH_LL_LOOP_DISPATCH][sample] = d[2 * i];
            times[EPX__BENCH_LL_LOOP_COMBINE][sample] = d[2 * i + 1];
            times[EPX__BENCH_LL_LOOP_STEP][sample] = d[2 * i] + d[2 * i + 1];
        }
    }
    for (int done = -warmup; done < iters; done += LOOP_STEPS) {
        barrier(lc);
        for (int i = 0; i < LOOP_STEPS; i++) {
            mark(lc, i);
            epx_ll_dispatch_result_t step = run_dispatch(lc, EPX_LL_SEND_ONLY);
            run_receive(lc, step.handle, "epx_ll_receive (dispatch)");
            epx_tensor_t x = combine_input(lc, step.handle);
            run_combine(lc, step.handle, &x, EPX_LL_SEND_ONLY);
            run_receive(lc, step.handle, "epx_ll_receive (combine)");
        }
        mark(lc, LOOP_STEPS);
        read_marks(lc, LOOP_STEPS + 1, d);
        for (int i = 0; i < LOOP_STEPS; i++) {
            int sample = done + i;
            if (sample >= 0 && sample < iters)
                times[EPX__BENCH_LL_LOOP_SPLIT][sample] = d[i];
        }
    }
}

/*
 * LOOP_STEPS plain steps captured once in a CUDA graph, then `warmup` + `iters` replays,
 * each timed: a sample is the replay's time / LOOP_STEPS. NaN on the host backend.
 */
static void time_graph(ll_case_t *lc, int warmup, int iters, double *times)
{
    void *graph = NULL;
    int cuda = lc->device->backend == EPX_BACKEND_CUDA;
    if (cuda) {
        epx__bench_must(lc->rank, epx__bench_graph_begin(lc->device), "graph capture");
        for (int i = 0; i < LOOP_STEPS; i++) {
            epx_ll_dispatch_result_t step = run_dispatch(lc, 0);
            epx_tensor_t x = combine_input(lc, step.handle);
            run_combine(lc, step.handle, &x, 0);
        }
        epx__bench_must(lc->rank, epx__bench_graph_end(lc->device, &graph), "graph capture");
    }
    for (int it = -warmup; it < iters; it++) {
        double d = NAN;
        if (cuda) {
            barrier(lc);
            mark(lc, 0);
            epx__bench_must(lc->rank, epx__bench_graph_launch(lc->device, graph), "graph launch");
            mark(lc, 1);
            read_marks(lc, 2, &d);
            d /= LOOP_STEPS;
        }
        if (it >= 0)
            times[it] = d;
    }
    epx__bench_graph_destroy(graph);
}

static void time_steps(ll_case_t *lc, int warmup, int iters,
                       double *times[EPX__BENCH_LL_OP_COUNT])
{
    for (int it = 0; it < warmup + iters; it++) {
        double t[EPX__BENCH_LL_OP_COUNT], whole[3];
        /* The whole calls, back to back like a decode step without overlap. */
        barrier(lc);
        mark(lc, 0);
        epx_ll_dispatch_result_t step = run_dispatch(lc, 0);
        mark(lc, 1);
        epx_tensor_t x = combine_input(lc, step.handle); /* a local lookup */
        mark(lc, 2);
        run_combine(lc, step.handle, &x, 0);
        mark(lc, 3);
        read_marks(lc, 4, whole);
        t[EPX__BENCH_LL_DISPATCH] = whole[0];
        t[EPX__BENCH_LL_COMBINE] = whole[2];

        /* The split: each half alone, every rank's send done before the receives. */
        barrier(lc);
        mark(lc, 0);
        step = run_dispatch(lc, EPX_LL_SEND_ONLY);
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_DISPATCH_SEND]);
        barrier(lc);
        mark(lc, 0);
        run_receive(lc, step.handle, "epx_ll_receive (dispatch)");
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_DISPATCH_RECV]);
        x = combine_input(lc, step.handle);
        barrier(lc);
        mark(lc, 0);
        run_combine(lc, step.handle, &x, EPX_LL_SEND_ONLY);
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_COMBINE_SEND]);
        barrier(lc);
        mark(lc, 0);
        run_receive(lc, step.handle, "epx_ll_receive (combine)");
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_COMBINE_RECV]);

        if (it >= warmup) {
            for (int op = 0; op <= EPX__BENCH_LL_COMBINE_RECV; op++)
                times[op][it - warmup] = t[op];
        }
    }
    time_loops(lc, warmup, iters, times);
    time_graph(lc, warmup, iters, times[EPX__BENCH_LL_GRAPH_STEP]);
}

/* ---------------------------------------------------------------- one case */

static void *alloc_copy(ll_case_t *lc, const void *host, size_t bytes)
{
    void *data = NULL;
    epx__bench_must(lc->rank, epx__bench_alloc(lc->device, bytes, &data), "bench allocation");
    if (host != NULL)
        epx__bench_must(lc->rank, epx__bench_copy_in(lc->device, data, host, bytes), "bench copy");
    return data;
}

static void setup(ll_case_t *lc)
{
    const moe_case_t *c = &lc->moe;
    if (moe_ll_inputs_make(c, lc->rank, &lc->inputs) != 0) {
        fprintf(stderr, "epx bench: rank %d: out of memory making the inputs\n", lc->rank);
        exit(1);
    }
    size_t tokens = (size_t)lc->inputs.num_tokens, topk = (size_t)c->num_topk;
    lc->x = alloc_copy(lc, lc->inputs.x, tokens * (size_t)c->hidden * 2);
    lc->topk_idx = alloc_copy(lc, lc->inputs.topk_idx, tokens * topk * 8);
    lc->topk_weights = alloc_copy(lc, lc->inputs.topk_weights, tokens * topk * 4);
    lc->out = alloc_copy(lc, NULL, tokens * (size_t)c->hidden * 2);
    /* One row per (token, distinct expert): a token naming an expert twice sends once. */
    lc->sent_rows = 0;
    for (size_t t = 0; t < tokens; t++) {
        const int64_t *idx = lc->inputs.topk_idx + t * topk;
        for (size_t j = 0; j < topk; j++) {
            int first = idx[j] >= 0;
            for (size_t i = 0; i < j && first; i++)
                first = idx[i] != idx[j];
            lc->sent_rows += first;
        }
    }
}

static void teardown(ll_case_t *lc)
{
    void *memory[] = {lc->x, lc->topk_idx, lc->topk_weights, lc->out};
    for (size_t i = 0; i < sizeof(memory) / sizeof(memory[0]); i++)
        epx__bench_free(lc->device, memory[i]);
    moe_inputs_free(&lc->inputs);
    free(lc->recv_count);
    free(lc->expert_first);
    free(lc->expert_out);
}

/*
 * rows[op] from every rank's times ([rank][op][iteration]) and summaries: rank 0's
 * statistics, each rank's (into per_rank[op * ranks + rank]), the slowest rank's, and the
 * bytes and floor of DESIGN.md section 5.
 */
static void make_rows(const ll_case_t *lc, epx_dtype_t dtype, const double *times, int iters,
                      const rank_summary_t *all, epx__bench_stats_t *per_rank,
                      epx__bench_ll_row_t rows[EPX__BENCH_LL_OP_COUNT])
{
    int world = lc->world_size;
    int64_t hidden = lc->moe.hidden;
    int64_t dispatch_row = is_fp8(lc) ? hidden + hidden / 128 * 4 : hidden * 2;
    int64_t combine_row = hidden * 2;
    int64_t sent = 0, received = 0, tokens = 0;
    for (int r = 0; r < world; r++) {
        sent += all[r].sent_rows;
        received += all[r].recv_rows;
        tokens += all[r].tokens;
    }
    double *slowest = host_alloc(lc, (size_t)(iters > 0 ? iters : 1) * sizeof(double), "times");
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++) {
        epx__bench_ll_row_t *row = &rows[op];
        memset(row, 0, sizeof(*row));
        row->dtype = dtype;
        row->op = (epx__bench_ll_op_t)op;
        /* NaN (not timed: CUDA graphs on the host backend) stays NaN. */
        for (int it = 0; it < iters; it++)
            slowest[it] = NAN;
        for (int r = 0; r < world; r++) {
            const double *mine = times + ((size_t)r * EPX__BENCH_LL_OP_COUNT + (size_t)op) *
                                             (size_t)iters;
            per_rank[op * world + r] = epx__bench_stats(mine, iters);
            for (int it = 0; it < iters; it++)
                if (!isnan(mine[it]) && (isnan(slowest[it]) || mine[it] > slowest[it]))
                    slowest[it] = mine[it];
        }
        row->per_rank = &per_rank[op * world];
        row->rank0 = row->per_rank[0];
        row->slowest = epx__bench_stats(slowest, iters);

        int is_dispatch = op == EPX__BENCH_LL_DISPATCH || op == EPX__BENCH_LL_DISPATCH_SEND ||
                          op == EPX__BENCH_LL_DISPATCH_RECV || op == EPX__BENCH_LL_LOOP_DISPATCH;
        int is_step = op == EPX__BENCH_LL_LOOP_STEP || op == EPX__BENCH_LL_LOOP_SPLIT ||
                      op == EPX__BENCH_LL_GRAPH_STEP;
        /* Dispatch: every row sent is read once and written once. Combine: every expert
         * row read once, one reduced row per token written. */
        int64_t dispatch_floor = 2 * sent * dispatch_row;
        int64_t combine_floor = received * combine_row + tokens * combine_row;
        if (is_step) {
            row->bytes_per_rank = all[0].sent_rows * dispatch_row + all[0].recv_rows * combine_row;
            row->total_bytes = sent * dispatch_row + received * combine_row;
            row->floor_bytes = dispatch_floor + combine_floor;
        } else if (is_dispatch) {
            row->bytes_per_rank = all[0].sent_rows * dispatch_row;
            row->total_bytes = sent * dispatch_row;
            if (op == EPX__BENCH_LL_DISPATCH || op == EPX__BENCH_LL_LOOP_DISPATCH)
                row->floor_bytes = dispatch_floor;
        } else {
            row->bytes_per_rank = all[0].recv_rows * combine_row;
            row->total_bytes = received * combine_row;
            if (op == EPX__BENCH_LL_COMBINE || op == EPX__BENCH_LL_LOOP_COMBINE)
                row->floor_bytes = combine_floor;
        }
        row->check = lc->options->check ? EPX__BENCH_CHECK_PASS : EPX__BENCH_CHECK_NONE;
        for (int r = 0; r < world; r++) {
            if (all[r].check[op] == EPX__BENCH_CHECK_FAIL)
                row->check = EPX__BENCH_CHECK_FAIL;
        }
    }
    free(slowest);
}

/* One dispatch dtype. Returns 1 when some rank's check failed. */
static int run_case(epx_group_t group, epx_buffer_t buffer, const epx__bench_options_t *options,
                    epx__bench_device_t *device, const epx__bench_context_t *context,
                    epx_dtype_t dtype, epx__bench_stats_t *per_rank,
                    epx__bench_ll_row_t rows[EPX__BENCH_LL_OP_COUNT])
{
    ll_case_t lc;
    memset(&lc, 0, sizeof(lc));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    lc.group = group;
    lc.options = options;
    lc.device = device;
    lc.buffer = buffer;
    lc.rank = info.rank;
    lc.world_size = info.world_size;
    lc.num_local = options->experts / info.world_size;
    lc.rows = options->tokens * info.world_size;
    /* x is bf16 in; the oracle's inputs: random routing, no dropped entries (the node
     * split is normal-mode combine's; moe_ll.c has the low-latency order). */
    moe_case_t moe = {info.world_size, options->tokens, options->hidden, options->experts,
                      options->topk, EPX_DTYPE_BF16, 1, options->seed, MOE_ROUTING_RANDOM,
                      0.0, -1, 0};
    lc.moe = moe;
    if (dtype == EPX_DTYPE_FP8_E4M3) {
        lc.cast.use_fp8 = 1;
        lc.cast.round_scale = options->round_scale;
        lc.cast.use_ue8m0 = options->use_ue8m0;
    }
    snprintf(lc.label, sizeof(lc.label), "rank %d %s", lc.rank,
             dtype == EPX_DTYPE_FP8_E4M3 ? "fp8" : "bf16");

    setup(&lc);
    rank_summary_t mine;
    memset(&mine, 0, sizeof(mine));
    run_first(&lc, mine.check);
    mine.sent_rows = lc.sent_rows;
    mine.recv_rows = lc.recv_rows;
    mine.tokens = lc.inputs.num_tokens;

    int iters = context->iters;
    size_t per_rank_times = (size_t)iters * EPX__BENCH_LL_OP_COUNT;
    double *my_times = host_alloc(&lc, per_rank_times * sizeof(double), "times");
    double *times[EPX__BENCH_LL_OP_COUNT];
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++)
        times[op] = my_times + (size_t)op * (size_t)iters;
    time_steps(&lc, context->warmup, iters, times);
    /* The loops and graph replays end with a plain step: its output must still be right. */
    if (lc.expected_out != NULL &&
        !check_combine(&lc, "combine out after the back-to-back loops", lc.expected_out))
        mine.check[EPX__BENCH_LL_LOOP_STEP] = mine.check[EPX__BENCH_LL_LOOP_SPLIT] =
            mine.check[EPX__BENCH_LL_GRAPH_STEP] = EPX__BENCH_CHECK_FAIL;
    free(lc.expected_out);
    lc.expected_out = NULL;

    double *all_times =
        host_alloc(&lc, per_rank_times * (size_t)lc.world_size * sizeof(double), "times");
    rank_summary_t *all = host_alloc(&lc, (size_t)lc.world_size * sizeof(*all), "summaries");
    epx__bench_allgather(group, my_times, all_times, per_rank_times * sizeof(double),
                         "gathering times");
    epx__bench_allgather(group, &mine, all, sizeof(mine), "gathering check results");
    make_rows(&lc, dtype, all_times, iters, all, per_rank, rows);

    int failed = 0;
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++)
        failed |= rows[op].check == EPX__BENCH_CHECK_FAIL;
    free(my_times);
    free(all_times);
    free(all);
    teardown(&lc);
    return failed;
}

int epx__bench_ll_run(epx_group_t group, const epx__bench_options_t *options,
                      epx__bench_device_t *device, const epx__bench_context_t *context)
{
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = options->tokens;
    config.hidden = options->hidden;
    config.num_experts = options->experts;
    config.num_topk = options->topk;
    config.num_sms = options->sms;
    config.max_low_latency_tokens = options->tokens;
    /* fp8 rows when the run dispatches fp8 only (bench.c chose it unless --ll-dtype). */
    config.low_latency_dtype = options->ll_dtype;
    /* The buffer's memory, and the part of it that low-latency mode adds. */
    epx_buffer_config_t normal_only = config;
    normal_only.max_low_latency_tokens = 0;
    size_t bytes = 0, normal_bytes = 0;
    epx__bench_must(info.rank, epx_buffer_size(group, &config, &bytes), "epx_buffer_size");
    epx__bench_must(info.rank, epx_buffer_size(group, &normal_only, &normal_bytes),
                    "epx_buffer_size");
    epx__bench_ll_context_t ll = {context, options->round_scale, options->use_ue8m0,
                                  (int64_t)bytes,
                                  bytes > normal_bytes ? (int64_t)(bytes - normal_bytes) : 0,
                                  options->ll_dtype};
    epx_buffer_t buffer = NULL;
    epx__bench_must(info.rank, epx_buffer_create(group, &config, &buffer), "epx_buffer_create");
    if (info.rank == 0 && !options->json)
        epx__bench_ll_print_header(stdout, &ll);

    int failed = 0;
    const epx_dtype_t dtypes[] = {EPX_DTYPE_BF16, EPX_DTYPE_FP8_E4M3};
    for (int d = 0; d < 2; d++) {
        if ((d == 0 && !options->run_bf16) || (d == 1 && !options->run_fp8))
            continue;
        epx__bench_ll_row_t rows[EPX__BENCH_LL_OP_COUNT];
        epx__bench_stats_t *per_rank = calloc(
            (size_t)EPX__BENCH_LL_OP_COUNT * (size_t)info.world_size, sizeof(*per_rank));
        if (per_rank == NULL) {
            fprintf(stderr, "epx bench: rank %d: out of memory\n", info.rank);
            exit(1);
        }
        failed |= run_case(group, buffer, options, device, context, dtypes[d], per_rank, rows);
        if (info.rank == 0) {
            for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++)
                epx__bench_ll_print_row(stdout, &ll, &rows[op], options->json);
            if (!options->json)
                epx__bench_ll_print_per_rank(stdout, &ll, rows, EPX__BENCH_LL_OP_COUNT);
        }
        free(per_rank);
    }
    epx__bench_must(info.rank, epx_buffer_destroy(buffer), "epx_buffer_destroy");
    return failed;
}
