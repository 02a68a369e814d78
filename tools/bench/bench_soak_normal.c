/*
 * One normal-mode round of the soak (bench_soak.h): a fresh dispatch with a shape drawn
 * for this round, sometimes a cached dispatch with its handle, then a combine (from the
 * buffer's combine-input view or from a separate tensor); on a checked round every
 * result is compared with the oracle (tests/common/moe_case.h) bit for bit.
 *
 * The shape: tokens 0..max (the same count on every rank; sometimes one rank passes
 * none), bf16 or fp8, routing uniform, home-rank first, all to one expert (skew) or with
 * a repeated expert, a fraction of -1 entries, an expert alignment. Every rank draws the
 * same shape from the round's seed, so no rank waits for another to choose.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_soak.h"
#include "common/tool.h"
#include "moe_case.h"

typedef struct {
    epx__soak_t *soak;
    moe_case_t c;
    moe_inputs_t in;
    int64_t tokens; /* this rank's */
    int fp8;
    int64_t scale_cols;
    char label[64];
} normal_round_t;

static void draw_shape(normal_round_t *r, uint64_t seed)
{
    epx__soak_t *soak = r->soak;
    uint64_t state = seed;
    moe_case_t *c = &r->c;
    memset(c, 0, sizeof(*c));
    c->world_size = soak->world;
    c->ranks_per_node = soak->ranks_per_node < soak->world ? soak->ranks_per_node : 0;
    c->num_tokens = epx__soak_below(&state, 8) == 0 ? soak->max_tokens
                                                     : epx__soak_below(&state, soak->max_tokens + 1);
    c->hidden = soak->hidden;
    c->num_experts = soak->experts;
    c->num_topk = soak->topk;
    r->fp8 = soak->hidden % 128 == 0 && epx__soak_below(&state, 2) == 1;
    c->dtype = r->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    static const int alignments[] = {1, 1, 4, 32};
    c->expert_alignment = alignments[epx__soak_below(&state, 4)];
    static const double drops[] = {0.0, 0.0, 0.1, 0.5, 1.0};
    epx__soak_draw_routing(&state, soak->world, drops, 5, c);
    r->scale_cols = soak->hidden / 128;
    snprintf(r->label, sizeof(r->label), "soak rank %d normal %s", soak->rank,
             r->fp8 ? "fp8" : "bf16");
}

static void fail(epx__soak_round_t *out, int rank, const char *what, epx_status_t status)
{
    fprintf(stderr, "epx bench: soak: rank %d: %s failed: %s: %s\n", rank, what,
            epx_status_name(status), epx__tool_error_text());
    out->failed = 1;
}

/* Copy `rows` rows of a result tensor to new host memory (NULL on failure). */
static void *copy_out(normal_round_t *r, const epx_tensor_t *t, int64_t rows, int64_t cols)
{
    size_t element = epx_dtype_size(t->dtype);
    void *host = malloc(rows > 0 ? (size_t)(rows * cols) * element : 1);
    if (host == NULL || t->data == NULL)
        return host;
    int64_t stride = t->strides[0] != 0 ? t->strides[0] : cols;
    if (epx__bench_copy_rows_out(r->soak->device, host, t->data, rows, (size_t)cols * element,
                                 (size_t)stride * element) != EPX_SUCCESS) {
        free(host);
        return NULL;
    }
    return host;
}

static int compare(normal_round_t *r, const char *what, const epx_tensor_t *t, epx_dtype_t dtype,
                   const void *expected, int64_t rows, int64_t cols)
{
    if (rows == 0)
        return 1;
    if (t->data == NULL || t->dtype != dtype) {
        fprintf(stderr, "epx bench: %s: %s missing or of dtype %s\n", r->label, what,
                epx_dtype_name(t->dtype));
        return 0;
    }
    void *got = copy_out(r, t, rows, cols);
    int ok = got != NULL && epx__bench_compare(r->label, what, dtype, got, expected, rows, cols);
    free(got);
    return ok;
}

static int check_dispatch(normal_round_t *r, const moe_expected_t *e,
                          const epx_dispatch_result_t *got, int cached)
{
    const char *op = cached ? "cached dispatch" : "dispatch";
    char what[96];
    if (got->num_recv_tokens != e->num_recv) {
        fprintf(stderr, "epx bench: %s: %s received %lld rows, oracle %lld\n", r->label, op,
                (long long)got->num_recv_tokens, (long long)e->num_recv);
        return 0;
    }
    snprintf(what, sizeof(what), "%s recv_x", op);
    int ok = compare(r, what, &got->recv_x, r->c.dtype, e->recv_x, e->num_recv, r->c.hidden);
    if (r->fp8) {
        snprintf(what, sizeof(what), "%s recv_x_scales", op);
        ok &= compare(r, what, &got->recv_x_scales, EPX_DTYPE_FP32, e->recv_x_scales, e->num_recv,
                      r->scale_cols);
    }
    if (!cached) {
        ok &= compare(r, "dispatch recv_topk_idx", &got->recv_topk_idx, EPX_DTYPE_INT64,
                      e->recv_topk_idx, e->num_recv, r->c.num_topk);
        ok &= compare(r, "dispatch recv_topk_weights", &got->recv_topk_weights, EPX_DTYPE_FP32,
                      e->recv_topk_weights, e->num_recv, r->c.num_topk);
    }
    if (got->num_recv_tokens_per_expert == NULL) {
        fprintf(stderr, "epx bench: %s: %s gave no per-expert counts\n", r->label, op);
        return 0;
    }
    snprintf(what, sizeof(what), "%s num_recv_tokens_per_expert", op);
    ok &= epx__bench_compare(r->label, what, EPX_DTYPE_INT32, got->num_recv_tokens_per_expert,
                             e->num_recv_per_expert, 1, e->num_local_experts);
    return ok;
}

/* The combine input rows: the oracle's when checking, else whatever x arrived. */
static void *combine_rows(normal_round_t *r, const moe_expected_t *e, int64_t recv)
{
    int64_t hidden = r->c.hidden;
    uint16_t *rows = calloc((size_t)(recv > 0 ? recv : 1) * (size_t)hidden, 2);
    if (rows == NULL || e == NULL)
        return rows;
    for (int64_t i = 0; i < recv; i++)
        moe_combine_row(&r->c, r->soak->rank, e->recv_src_rank[i], e->recv_src_token[i],
                        rows + i * hidden);
    return rows;
}

void epx__soak_normal_round(epx__soak_t *soak, uint64_t seed, int check, epx__soak_round_t *out)
{
    normal_round_t r;
    memset(&r, 0, sizeof(r));
    r.soak = soak;
    draw_shape(&r, seed);
    uint64_t state = seed ^ 0x5bd1e995ull;
    int cached = epx__soak_below(&state, 3) == 0;
    int from_view = epx__soak_below(&state, 2) == 0;
    if (moe_inputs_make(&r.c, soak->rank, &r.in) != 0) {
        fprintf(stderr, "epx bench: soak: rank %d: out of memory for the inputs\n", soak->rank);
        out->failed = 1;
        return;
    }
    int64_t n = r.in.num_tokens, hidden = r.c.hidden, k = r.c.num_topk;
    size_t x_bytes = (size_t)(n * hidden) * epx_dtype_size(r.c.dtype);
    epx__bench_device_t *device = soak->device;
    epx_status_t status = epx__soak_copy_inputs(soak, &r.c, &r.in, x_bytes,
                                                r.fp8 ? (size_t)(n * r.scale_cols) * 4 : 0);
    if (status != EPX_SUCCESS) {
        fail(out, soak->rank, "copying the inputs", status);
        moe_inputs_free(&r.in);
        return;
    }

    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(soak->x, r.c.dtype, n, hidden);
    if (r.fp8)
        args.x_scales = epx_tensor_2d(soak->x_scales, EPX_DTYPE_FP32, n, r.scale_cols);
    args.topk_idx = epx_tensor_2d(soak->topk_idx, EPX_DTYPE_INT64, n, k);
    args.topk_weights = epx_tensor_2d(soak->topk_weights, EPX_DTYPE_FP32, n, k);
    args.expert_alignment = r.c.expert_alignment;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    epx__soak_start_op(soak);
    status = epx_dispatch(soak->buffer, &args, &result, device->stream);
    epx__soak_mark(soak, 1);
    if (status != EPX_SUCCESS) {
        fail(out, soak->rank, "epx_dispatch", status);
        moe_inputs_free(&r.in);
        return;
    }
    out->us[EPX__SOAK_DISPATCH] = epx__soak_elapsed_us(soak);
    out->ran[EPX__SOAK_DISPATCH] = 1;

    moe_expected_t e;
    memset(&e, 0, sizeof(e));
    int have_oracle = check && moe_oracle_dispatch(&r.c, soak->rank, &e) == 0;
    if (have_oracle) {
        out->checked++;
        out->mismatches += !check_dispatch(&r, &e, &result, 0);
    }
    int64_t recv = result.num_recv_tokens;

    if (cached && status == EPX_SUCCESS) {
        epx_dispatch_args_t again = args;
        again.handle = result.handle;
        again.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
        again.topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
        epx_dispatch_result_t cached_result = EPX_DISPATCH_RESULT_INIT;
        epx__soak_start_op(soak);
        status = epx_dispatch(soak->buffer, &again, &cached_result, device->stream);
        epx__soak_mark(soak, 1);
        if (status != EPX_SUCCESS) {
            fail(out, soak->rank, "epx_dispatch (cached)", status);
        } else {
            out->us[EPX__SOAK_CACHED_DISPATCH] = epx__soak_elapsed_us(soak);
            out->ran[EPX__SOAK_CACHED_DISPATCH] = 1;
            if (have_oracle) {
                out->checked++;
                out->mismatches += !check_dispatch(&r, &e, &cached_result, 1);
            }
        }
    }

    if (status == EPX_SUCCESS) {
        uint16_t *rows = combine_rows(&r, have_oracle ? &e : NULL, recv);
        epx_tensor_t x = EPX_TENSOR_NONE;
        if (from_view)
            status = epx_get_combine_input(soak->buffer, result.handle, &x);
        else
            x = epx_tensor_2d(soak->combine_x, EPX_DTYPE_BF16, recv, hidden);
        if (status == EPX_SUCCESS && have_oracle && rows != NULL)
            status = epx__bench_copy_in(device, x.data, rows, (size_t)(recv * hidden) * 2);
        free(rows);
        epx_combine_args_t cargs = EPX_COMBINE_ARGS_INIT;
        cargs.handle = result.handle;
        cargs.x = x;
        cargs.out_x = epx_tensor_2d(soak->out_x, EPX_DTYPE_BF16, n, hidden);
        if (status == EPX_SUCCESS) {
            epx__soak_start_op(soak);
            status = epx_combine(soak->buffer, &cargs, device->stream);
            epx__soak_mark(soak, 1);
        }
        if (status != EPX_SUCCESS) {
            fail(out, soak->rank, "epx_combine", status);
        } else {
            out->us[EPX__SOAK_COMBINE] = epx__soak_elapsed_us(soak);
            out->ran[EPX__SOAK_COMBINE] = 1;
            uint16_t *want = NULL;
            if (have_oracle && moe_oracle_combine(&r.c, soak->rank, &want) == 0) {
                out->checked++;
                uint16_t *got = copy_out(&r, &cargs.out_x, n, hidden);
                out->mismatches += got == NULL ||
                                   !epx__bench_compare_bf16(r.label, "combine out_x", got, want, n,
                                                            hidden, soak->cuda ? 1 : 0);
                free(got);
            }
            free(want);
        }
    }
    if (result.handle != NULL)
        epx_handle_destroy(result.handle);
    if (have_oracle)
        moe_expected_free(&e);
    moe_inputs_free(&r.in);
}
