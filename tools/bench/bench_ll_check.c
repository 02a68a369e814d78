/*
 * `epx bench --mode ll`: the first step of a case, and its results checked against the
 * oracle (tests/common/moe_ll.c) with --check: shapes, the layout learnt from the step,
 * every local expert's rows, the combine output.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_ll.h"
#include "bench_ll_case.h"
#include "moe_ll.h"

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
    void *host = epx__bench_ll_host_alloc(lc, (size_t)rows * row_bytes, "copying results");
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
    int ok = check_shape(lc, what, &r->recv_x, epx__bench_ll_is_fp8(lc) ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16,
                         3, lc->num_local, lc->rows, hidden);
    if (epx__bench_ll_is_fp8(lc)) {
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
    lc->recv_count = epx__bench_ll_host_alloc(lc, (size_t)num_local * sizeof(int32_t), "counts");
    lc->expert_first = epx__bench_ll_host_alloc(lc, (size_t)num_local * sizeof(int64_t), "counts");
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
        epx__bench_ll_host_alloc(lc, (size_t)lc->recv_rows * (size_t)hidden * 2, "the expert outputs");
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
    uint8_t *bytes = epx__bench_ll_host_alloc(lc, (size_t)count, "expected scales");
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
    epx_dtype_t x_dtype = epx__bench_ll_is_fp8(lc) ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    void *x = copy_expert(lc, &r->recv_x, l, n);
    ok = ok && compare_expert(lc, op, "recv_x", l, x_dtype, x,
                              (const char *)e->x + (size_t)first * (size_t)hidden *
                                                       epx_dtype_size(x_dtype),
                              n, hidden);
    free(x);
    if (!ok || !epx__bench_ll_is_fp8(lc))
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

int epx__bench_ll_check_combine(ll_case_t *lc, const char *what, const uint16_t *expected)
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
void epx__bench_ll_run_first(ll_case_t *lc, int32_t check[EPX__BENCH_LL_OP_COUNT])
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
    /* The oracle takes each rank a different time, and the first operation's waits for
     * peers count from its start: start it together. */
    epx__bench_must(lc->rank, epx_group_barrier(lc->group), "epx_group_barrier");

    /* The whole calls. */
    epx_ll_dispatch_result_t whole = epx__bench_ll_run_dispatch(lc, 0);
    learn_layout(lc, &whole);
    if (checking && !check_dispatch(lc, "dispatch", &expected, &whole))
        check[EPX__BENCH_LL_DISPATCH] = EPX__BENCH_CHECK_FAIL;
    epx_tensor_t x = epx__bench_ll_combine_input(lc, whole.handle);
    clear_out(lc); /* so that no check can pass on an earlier result */
    epx__bench_ll_run_combine(lc, whole.handle, &x, 0);
    if (checking && !epx__bench_ll_check_combine(lc, "combine out", expected_out))
        check[EPX__BENCH_LL_COMBINE] = EPX__BENCH_CHECK_FAIL;

    /* The split, into the other slot. */
    epx_ll_dispatch_result_t split = epx__bench_ll_run_dispatch(lc, EPX_LL_SEND_ONLY);
    epx__bench_ll_run_receive(lc, split.handle, "epx_ll_receive (dispatch)");
    if (checking && !check_dispatch(lc, "dispatch (send + receive)", &expected, &split))
        check[EPX__BENCH_LL_DISPATCH_SEND] = check[EPX__BENCH_LL_DISPATCH_RECV] =
            EPX__BENCH_CHECK_FAIL;
    x = epx__bench_ll_combine_input(lc, split.handle);
    clear_out(lc);
    epx__bench_ll_run_combine(lc, split.handle, &x, EPX_LL_SEND_ONLY);
    epx__bench_ll_run_receive(lc, split.handle, "epx_ll_receive (combine)");
    if (checking && !epx__bench_ll_check_combine(lc, "combine (send + receive) out", expected_out))
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
