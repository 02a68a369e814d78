/*
 * Comparisons of normal-mode results against the oracle (see normal_check.h).
 */
#include "normal_check.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "mem.h"

void nt_fail(const nt_ctx_t *ctx, const char *step, const char *fmt, ...)
{
    va_list args;
    fprintf(stderr, "FAIL case %s, rank %d, %s: ", ctx->case_name, ctx->rank, step);
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fprintf(stderr, "\n");
    exit(1);
}

void nt_check_layout(const nt_ctx_t *ctx, const int32_t *per_rank, const int32_t *per_expert,
                     const uint8_t *in_rank)
{
    const moe_case_t *c = ctx->c;
    const moe_expected_t *e = ctx->e;
    const char *step = "layout";
    for (int r = 0; r < c->world_size; r++)
        if (per_rank[r] != e->num_tokens_per_rank[r])
            nt_fail(ctx, step, "num_tokens_per_rank[%d] is %d, expected %d", r, per_rank[r],
                    e->num_tokens_per_rank[r]);
    for (int x = 0; x < c->num_experts; x++)
        if (per_expert[x] != e->num_tokens_per_expert[x])
            nt_fail(ctx, step, "num_tokens_per_expert[%d] is %d, expected %d", x, per_expert[x],
                    e->num_tokens_per_expert[x]);
    for (int64_t t = 0; t < ctx->in->num_tokens; t++)
        for (int r = 0; r < c->world_size; r++) {
            int64_t i = t * c->world_size + r;
            if (in_rank[i] != e->is_token_in_rank[i])
                nt_fail(ctx, step, "is_token_in_rank[%lld][%d] is %d, expected %d",
                        (long long)t, r, in_rank[i], e->is_token_in_rank[i]);
        }
}

static void *host_alloc(int64_t count, size_t element)
{
    void *memory = calloc(count > 0 ? (size_t)count : 1, element);
    if (memory == NULL) {
        fprintf(stderr, "FAIL: out of memory\n");
        exit(1);
    }
    return memory;
}

/* The result's shape must fit what was received: dtype, columns, enough rows. */
static void check_result_tensor(const nt_ctx_t *ctx, const char *step, const char *name,
                                const epx_tensor_t *tensor, epx_dtype_t dtype, int64_t rows,
                                int64_t cols)
{
    if (tensor->data == NULL)
        nt_fail(ctx, step, "result %s has no data", name);
    if (tensor->dtype != dtype)
        nt_fail(ctx, step, "result %s has dtype %s, expected %s", name,
                epx_dtype_name(tensor->dtype), epx_dtype_name(dtype));
    if (tensor->ndim != 2 || tensor->shape[0] < rows || tensor->shape[1] != cols)
        nt_fail(ctx, step, "result %s has shape [%lld, %lld] (ndim %d), expected [>= %lld, %lld]",
                name, (long long)tensor->shape[0], (long long)tensor->shape[1], tensor->ndim,
                (long long)rows, (long long)cols);
}

void nt_recv_download(const nt_ctx_t *ctx, const char *step, const epx_dispatch_result_t *res,
                      nt_recv_t *out)
{
    const moe_case_t *c = ctx->c;
    int k = c->num_topk;
    memset(out, 0, sizeof *out);
    out->num_local_experts = res->num_local_experts;
    out->num_recv = res->num_recv_tokens;
    if (out->num_recv < 0) {
        /* Worst-case mode on a GPU: the counts exist only on the device. */
        int32_t rows = 0;
        if (res->num_recv_tokens_device == NULL)
            nt_fail(ctx, step, "num_recv_tokens is %lld and there is no device count",
                    (long long)res->num_recv_tokens);
        mr_mem_to_host(&rows, res->num_recv_tokens_device, sizeof rows);
        out->num_recv = rows;
    }
    if (out->num_recv != ctx->e->num_recv)
        nt_fail(ctx, step, "received %lld tokens, expected %lld", (long long)out->num_recv,
                (long long)ctx->e->num_recv);
    if (out->num_local_experts != ctx->e->num_local_experts)
        nt_fail(ctx, step, "num_local_experts is %d, expected %d", out->num_local_experts,
                ctx->e->num_local_experts);

    out->per_expert = host_alloc(out->num_local_experts, sizeof(int32_t));
    if (res->num_recv_tokens_per_expert != NULL)
        memcpy(out->per_expert, res->num_recv_tokens_per_expert,
               (size_t)out->num_local_experts * sizeof(int32_t));
    else if (res->num_recv_tokens_per_expert_device != NULL)
        mr_mem_to_host(out->per_expert, res->num_recv_tokens_per_expert_device,
                       (size_t)out->num_local_experts * sizeof(int32_t));
    else
        nt_fail(ctx, step, "no tokens-per-expert counts, on the host or the device");

    int64_t n = out->num_recv;
    check_result_tensor(ctx, step, "recv_x", &res->recv_x, c->dtype, n, c->hidden);
    out->x = host_alloc(n * c->hidden, epx_dtype_size(c->dtype));
    mr_tensor_to_host(&res->recv_x, n, out->x);
    if (c->dtype == EPX_DTYPE_FP8_E4M3) {
        check_result_tensor(ctx, step, "recv_x_scales", &res->recv_x_scales, EPX_DTYPE_FP32,
                            n, c->hidden / 128);
        out->scales = host_alloc(n * (c->hidden / 128), sizeof(float));
        mr_tensor_to_host(&res->recv_x_scales, n, out->scales);
    } else if (res->recv_x_scales.data != NULL) {
        nt_fail(ctx, step, "result recv_x_scales is given for bf16 x");
    }
    if (res->recv_topk_idx.data != NULL) {
        check_result_tensor(ctx, step, "recv_topk_idx", &res->recv_topk_idx, EPX_DTYPE_INT64,
                            n, k);
        out->idx = host_alloc(n * k, sizeof(int64_t));
        mr_tensor_to_host(&res->recv_topk_idx, n, out->idx);
    }
    if (res->recv_topk_weights.data != NULL) {
        check_result_tensor(ctx, step, "recv_topk_weights", &res->recv_topk_weights,
                            EPX_DTYPE_FP32, n, k);
        out->weights = host_alloc(n * k, sizeof(float));
        mr_tensor_to_host(&res->recv_topk_weights, n, out->weights);
    }
}

void nt_recv_free(nt_recv_t *recv)
{
    free(recv->x);
    free(recv->scales);
    free(recv->idx);
    free(recv->weights);
    free(recv->per_expert);
    memset(recv, 0, sizeof *recv);
}

static void check_x_rows(const nt_ctx_t *ctx, const char *step, const nt_recv_t *got)
{
    const moe_case_t *c = ctx->c;
    const moe_expected_t *e = ctx->e;
    size_t element = epx_dtype_size(c->dtype);
    size_t row_bytes = (size_t)c->hidden * element;
    for (int64_t i = 0; i < e->num_recv; i++) {
        const uint8_t *g = (const uint8_t *)got->x + (size_t)i * row_bytes;
        const uint8_t *w = (const uint8_t *)e->recv_x + (size_t)i * row_bytes;
        if (memcmp(g, w, row_bytes) == 0)
            continue;
        int64_t col = 0;
        while (memcmp(g + col * element, w + col * element, element) == 0)
            col++;
        unsigned gv = element == 1 ? g[col] : ((const uint16_t *)g)[col];
        unsigned wv = element == 1 ? w[col] : ((const uint16_t *)w)[col];
        nt_fail(ctx, step,
                "recv_x[%lld][%lld] (token %d of rank %d) is 0x%x, expected 0x%x",
                (long long)i, (long long)col, e->recv_src_token[i], e->recv_src_rank[i], gv, wv);
    }
    int64_t per_row = c->hidden / 128;
    if (c->dtype == EPX_DTYPE_FP8_E4M3)
        for (int64_t i = 0; i < e->num_recv * per_row; i++)
            if (memcmp(&got->scales[i], &e->recv_x_scales[i], sizeof(float)) != 0)
                nt_fail(ctx, step, "recv_x_scales[%lld][%lld] (token %d of rank %d) is %g, "
                        "expected %g",
                        (long long)(i / per_row), (long long)(i % per_row),
                        e->recv_src_token[i / per_row], e->recv_src_rank[i / per_row],
                        got->scales[i], e->recv_x_scales[i]);
}

void nt_check_recv(const nt_ctx_t *ctx, const char *step, const nt_recv_t *got, int want_idx,
                   int want_weights)
{
    const moe_expected_t *e = ctx->e;
    int k = ctx->c->num_topk;
    check_x_rows(ctx, step, got);
    for (int j = 0; j < e->num_local_experts; j++)
        if (got->per_expert[j] != e->num_recv_per_expert[j])
            nt_fail(ctx, step,
                    "num_recv_tokens_per_expert[%d] is %d, expected %d (alignment %d)", j,
                    got->per_expert[j], e->num_recv_per_expert[j], ctx->c->expert_alignment);
    if (want_idx && got->idx == NULL)
        nt_fail(ctx, step, "result has no recv_topk_idx");
    if (want_weights && got->weights == NULL)
        nt_fail(ctx, step, "result has no recv_topk_weights");
    for (int64_t i = 0; got->idx != NULL && i < e->num_recv * k; i++)
        if (got->idx[i] != e->recv_topk_idx[i])
            nt_fail(ctx, step, "recv_topk_idx[%lld][%lld] (token %d of rank %d) is %lld, "
                    "expected %lld",
                    (long long)(i / k), (long long)(i % k), e->recv_src_token[i / k],
                    e->recv_src_rank[i / k], (long long)got->idx[i],
                    (long long)e->recv_topk_idx[i]);
    for (int64_t i = 0; got->weights != NULL && i < e->num_recv * k; i++)
        if (got->weights[i] != e->recv_topk_weights[i])
            nt_fail(ctx, step, "recv_topk_weights[%lld][%lld] (token %d of rank %d) is %g, "
                    "expected %g",
                    (long long)(i / k), (long long)(i % k), e->recv_src_token[i / k],
                    e->recv_src_rank[i / k], got->weights[i], e->recv_topk_weights[i]);
}

void nt_check_bf16_rows(const nt_ctx_t *ctx, const char *step, const uint16_t *got,
                        const uint16_t *want, int64_t rows, int64_t hidden)
{
    for (int64_t i = 0; i < rows * hidden; i++)
        if (mr_bf16_ulps(got[i], want[i]) != 0)
            nt_fail(ctx, step, "out_x[%lld][%lld] is %g (0x%04x), expected %g (0x%04x)",
                    (long long)(i / hidden), (long long)(i % hidden),
                    moe_bf16_to_float(got[i]), got[i], moe_bf16_to_float(want[i]), want[i]);
}

void nt_check_combined_weights(const nt_ctx_t *ctx, const char *step, const float *got)
{
    int k = ctx->c->num_topk;
    const moe_inputs_t *in = ctx->in;
    for (int64_t i = 0; i < in->num_tokens * k; i++) {
        float want = in->topk_idx[i] >= 0 ? in->topk_weights[i] : 0.0f;
        int ok = want == 0.0f ? got[i] == 0.0f : fabsf(got[i] - want) <= 1e-6f * fabsf(want);
        if (!ok)
            nt_fail(ctx, step, "out_topk_weights[%lld][%lld] is %.9g, expected %.9g (expert %lld)",
                    (long long)(i / k), (long long)(i % k), got[i], want,
                    (long long)in->topk_idx[i]);
    }
}
