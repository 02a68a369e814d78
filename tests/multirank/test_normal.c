/*
 * Normal-mode dispatch and combine on every rank of a launched group, checked exactly
 * against the oracle (tests/common/moe_case.h).
 *
 *   epx launch -n N -- test_normal [--case NAME|all] [--backend host|cuda|auto]
 *
 * Each case of the table runs on a fresh buffer: layout; fresh dispatch into buffer
 * views and into caller outputs; combine with and without top-k weights, and through
 * the zero-copy input view (epx_get_combine_input); the round trip
 * combine(dispatch(x)) == x * (ranks that received it); cached dispatch; worst-case
 * dispatch; then more rounds with new seeds on the same buffer. Inputs and outputs live
 * in the backend's memory (mem.h), so the program runs unchanged on the GPU.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx_tool.h"
#include "harness.h"
#include "mem.h"
#include "moe_case.h"
#include "normal_check.h"
#include "test_util.h"

typedef struct {
    const char *name;
    int64_t num_tokens;
    int64_t max_tokens;     /* the buffer's max_tokens_per_rank (>= num_tokens) */
    int64_t hidden;
    int num_experts;        /* > 0: at least this many (rounded up to a multiple of R) */
    int experts_per_rank;   /* > 0: exactly this many per rank (num_experts unused) */
    int num_topk;           /* 0 = all experts; else clamped to the expert count */
    epx_dtype_t dtype;
    int expert_alignment;
    moe_routing_t routing;
    double drop_fraction;
    int empty_rank;         /* nonzero: rank 1 (rank 0 in a world of one) passes no tokens */
} normal_case_t;

static const normal_case_t cases[] = {
    /* name, tokens, max, hidden, experts, per rank, topk, dtype, align, routing, drop, empty */
    {"random_bf16", 128, 128, 256, 16, 0, 4, EPX_DTYPE_BF16, 1, MOE_ROUTING_RANDOM, 0, 0},
    {"random_fp8", 200, 256, 256, 16, 0, 4, EPX_DTYPE_FP8_E4M3, 1, MOE_ROUTING_RANDOM, 0, 0},
    {"drop_bf16", 96, 100, 256, 16, 0, 4, EPX_DTYPE_BF16, 1, MOE_ROUTING_RANDOM, 0.3, 0},
    {"drop_fp8", 64, 64, 384, 16, 0, 4, EPX_DTYPE_FP8_E4M3, 1, MOE_ROUTING_RANDOM, 0.3, 0},
    {"empty_rank", 80, 80, 256, 16, 0, 4, EPX_DTYPE_BF16, 1, MOE_ROUTING_RANDOM, 0, 1},
    {"one_expert", 64, 96, 256, 16, 0, 4, EPX_DTYPE_BF16, 1, MOE_ROUTING_ONE_EXPERT, 0, 0},
    {"experts_3r", 100, 100, 256, 0, 3, 2, EPX_DTYPE_BF16, 1, MOE_ROUTING_RANDOM, 0, 0},
    {"experts_6r_fp8", 72, 72, 256, 0, 6, 4, EPX_DTYPE_FP8_E4M3, 1, MOE_ROUTING_RANDOM, 0.1, 0},
    {"align4", 100, 128, 256, 16, 0, 4, EPX_DTYPE_BF16, 4, MOE_ROUTING_RANDOM, 0, 0},
    {"align128_fp8", 90, 90, 256, 16, 0, 4, EPX_DTYPE_FP8_E4M3, 128, MOE_ROUTING_LOCAL_FIRST,
     0.2, 0},
    {"top1", 150, 150, 256, 16, 0, 1, EPX_DTYPE_BF16, 1, MOE_ROUTING_RANDOM, 0, 0},
    {"topk_all", 40, 40, 128, 0, 2, 0, EPX_DTYPE_BF16, 1, MOE_ROUTING_RANDOM, 0, 0},
    {"local_first", 120, 120, 256, 16, 0, 4, EPX_DTYPE_BF16, 8, MOE_ROUTING_LOCAL_FIRST, 0, 0},
    /* An expert named twice in a token's row counts once (include/epx.h). */
    {"repeat_expert", 96, 96, 256, 16, 0, 4, EPX_DTYPE_BF16, 4, MOE_ROUTING_REPEAT, 0.1, 0},
};

#define NUM_CASES ((int)(sizeof cases / sizeof cases[0]))
#define NUM_ROUNDS 3 /* rounds on one buffer, each with a new seed */

static moe_case_t make_case(const normal_case_t *nc, const epx_group_info_t *info,
                            int case_index, int round)
{
    int world = info->world_size;
    moe_case_t c;
    memset(&c, 0, sizeof c);
    c.world_size = world;
    c.num_tokens = nc->num_tokens;
    c.hidden = nc->hidden;
    if (nc->experts_per_rank > 0)
        c.num_experts = nc->experts_per_rank * world;
    else
        c.num_experts = (nc->num_experts + world - 1) / world * world;
    c.num_topk = nc->num_topk == 0 || nc->num_topk > c.num_experts ? c.num_experts
                                                                    : nc->num_topk;
    c.dtype = nc->dtype;
    c.expert_alignment = nc->expert_alignment;
    c.seed = 1000003ull * (uint64_t)(case_index + 1) + 7919ull * (uint64_t)round;
    c.routing = nc->routing;
    c.drop_fraction = nc->drop_fraction;
    c.empty_rank = nc->empty_rank ? (world > 1 ? 1 : 0) : -1;
    c.ranks_per_node = info->ranks_per_node; /* combine's summation order */
    return c;
}

/* ---------------------------------------------------------------- operation memory */

/* One rank's inputs in host memory and in the backend's memory. */
typedef struct {
    moe_inputs_t host;
    void *x, *scales, *idx, *weights;
} inputs_t;

static void inputs_make(const moe_case_t *c, int rank, inputs_t *in)
{
    CHECK_EQ_INT(moe_inputs_make(c, rank, &in->host), 0);
    int64_t n = in->host.num_tokens;
    in->x = mr_mem_from_host(in->host.x, (size_t)(n * c->hidden) * epx_dtype_size(c->dtype));
    in->scales = c->dtype == EPX_DTYPE_FP8_E4M3
                     ? mr_mem_from_host(in->host.x_scales,
                                        (size_t)(n * (c->hidden / 128)) * sizeof(float))
                     : NULL;
    in->idx = mr_mem_from_host(in->host.topk_idx, (size_t)(n * c->num_topk) * sizeof(int64_t));
    in->weights = mr_mem_from_host(in->host.topk_weights,
                                   (size_t)(n * c->num_topk) * sizeof(float));
}

static void inputs_free(inputs_t *in)
{
    mr_mem_free(in->x);
    if (in->scales != NULL)
        mr_mem_free(in->scales);
    mr_mem_free(in->idx);
    mr_mem_free(in->weights);
    moe_inputs_free(&in->host);
}

/* Dispatch arguments for fresh mode (cached mode clears the routing afterwards). */
static epx_dispatch_args_t dispatch_args(const moe_case_t *c, const inputs_t *in)
{
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    int64_t n = in->host.num_tokens;
    args.x = epx_tensor_2d(in->x, c->dtype, n, c->hidden);
    if (c->dtype == EPX_DTYPE_FP8_E4M3)
        args.x_scales = epx_tensor_2d(in->scales, EPX_DTYPE_FP32, n, c->hidden / 128);
    args.topk_idx = epx_tensor_2d(in->idx, EPX_DTYPE_INT64, n, c->num_topk);
    args.topk_weights = epx_tensor_2d(in->weights, EPX_DTYPE_FP32, n, c->num_topk);
    args.expert_alignment = c->expert_alignment;
    return args;
}

/* Caller-owned dispatch outputs of `rows` rows, filled with NaN bytes. */
typedef struct {
    void *x, *scales, *idx, *weights;
} outputs_t;

static void outputs_attach(const moe_case_t *c, int64_t rows, outputs_t *out,
                           epx_dispatch_args_t *args)
{
    int k = c->num_topk;
    int fp8 = c->dtype == EPX_DTYPE_FP8_E4M3;
    out->x = mr_mem_alloc((size_t)(rows * c->hidden) * epx_dtype_size(c->dtype), 0xff);
    out->scales = fp8 ? mr_mem_alloc((size_t)(rows * (c->hidden / 128)) * 4, 0xff) : NULL;
    out->idx = mr_mem_alloc((size_t)(rows * k) * sizeof(int64_t), 0xff);
    out->weights = mr_mem_alloc((size_t)(rows * k) * sizeof(float), 0xff);
    args->recv_x = epx_tensor_2d(out->x, c->dtype, rows, c->hidden);
    if (fp8)
        args->recv_x_scales = epx_tensor_2d(out->scales, EPX_DTYPE_FP32, rows, c->hidden / 128);
    args->recv_topk_idx = epx_tensor_2d(out->idx, EPX_DTYPE_INT64, rows, k);
    args->recv_topk_weights = epx_tensor_2d(out->weights, EPX_DTYPE_FP32, rows, k);
}

static void outputs_free(outputs_t *out)
{
    mr_mem_free(out->x);
    if (out->scales != NULL)
        mr_mem_free(out->scales);
    mr_mem_free(out->idx);
    mr_mem_free(out->weights);
}

/* ---------------------------------------------------------------- steps */

static void check_layout(const nt_ctx_t *ctx, epx_buffer_t buffer, const inputs_t *in)
{
    const moe_case_t *c = ctx->c;
    int64_t n = in->host.num_tokens;
    int world = c->world_size;
    void *per_rank = mr_mem_alloc((size_t)world * 4, 0xff);
    void *per_expert = mr_mem_alloc((size_t)c->num_experts * 4, 0xff);
    void *in_rank = mr_mem_alloc((size_t)(n * world), 0xff);
    epx_layout_args_t args = EPX_LAYOUT_ARGS_INIT;
    args.topk_idx = epx_tensor_2d(in->idx, EPX_DTYPE_INT64, n, c->num_topk);
    args.num_tokens_per_rank = epx_tensor_1d(per_rank, EPX_DTYPE_INT32, world);
    args.num_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, c->num_experts);
    args.is_token_in_rank = epx_tensor_2d(in_rank, EPX_DTYPE_BOOL, n, world);
    CHECK_OK(epx_get_dispatch_layout(buffer, &args, NULL));

    int32_t *host_rank = calloc((size_t)world, 4);
    int32_t *host_expert = calloc((size_t)c->num_experts, 4);
    uint8_t *host_in_rank = calloc((size_t)(n * world) + 1, 1);
    CHECK(host_rank != NULL && host_expert != NULL && host_in_rank != NULL);
    mr_mem_to_host(host_rank, per_rank, (size_t)world * 4);
    mr_mem_to_host(host_expert, per_expert, (size_t)c->num_experts * 4);
    mr_mem_to_host(host_in_rank, in_rank, (size_t)(n * world));
    nt_check_layout(ctx, host_rank, host_expert, host_in_rank);
    free(host_rank);
    free(host_expert);
    free(host_in_rank);
    mr_mem_free(per_rank);
    mr_mem_free(per_expert);
    mr_mem_free(in_rank);
}

/* Download a dispatch result and compare it with the oracle. */
static void check_dispatch(const nt_ctx_t *ctx, const char *step,
                           const epx_dispatch_result_t *res, int want_routing)
{
    nt_recv_t got;
    nt_recv_download(ctx, step, res, &got);
    nt_check_recv(ctx, step, &got, want_routing, want_routing);
    nt_recv_free(&got);

    epx_handle_info_t info = EPX_HANDLE_INFO_INIT;
    CHECK_OK(epx_handle_get_info(res->handle, &info));
    /* A GPU backend in worst-case mode may not know the received count on the host. */
    int64_t want_recv = res->num_recv_tokens < 0 && info.num_recv_tokens < 0
                            ? info.num_recv_tokens
                            : ctx->e->num_recv;
    if (info.num_tokens != ctx->in->num_tokens || info.num_recv_tokens != want_recv ||
        info.num_local_experts != ctx->e->num_local_experts ||
        info.expert_alignment != ctx->c->expert_alignment)
        nt_fail(ctx, step,
                "handle info (tokens %lld, received %lld, local experts %d, alignment %d), "
                "expected (%lld, %lld, %d, %d)",
                (long long)info.num_tokens, (long long)info.num_recv_tokens,
                info.num_local_experts, info.expert_alignment,
                (long long)ctx->in->num_tokens, (long long)ctx->e->num_recv,
                ctx->e->num_local_experts, ctx->c->expert_alignment);
}

static epx_handle_t dispatch_fresh_views(const nt_ctx_t *ctx, epx_buffer_t buffer,
                                         const inputs_t *in, const char *step)
{
    epx_dispatch_args_t args = dispatch_args(ctx->c, in);
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    check_dispatch(ctx, step, &res, 1);
    return res.handle;
}

/*
 * Dispatch into caller outputs of `rows` rows (with `flags`). The outputs stay
 * allocated in `out` for the caller to use and free.
 */
static epx_handle_t dispatch_fresh_outputs(const nt_ctx_t *ctx, epx_buffer_t buffer,
                                           const inputs_t *in, int64_t rows, uint32_t flags,
                                           outputs_t *out, const char *step)
{
    epx_dispatch_args_t args = dispatch_args(ctx->c, in);
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    args.flags = flags;
    outputs_attach(ctx->c, rows, out, &args);
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    if (res.recv_x.data != out->x)
        nt_fail(ctx, step, "result recv_x does not point at the caller's output");
    check_dispatch(ctx, step, &res, 1);
    return res.handle;
}

static void dispatch_cached(const nt_ctx_t *ctx, epx_buffer_t buffer, const inputs_t *in,
                            epx_handle_t handle)
{
    const char *step = "cached dispatch";
    epx_dispatch_args_t args = dispatch_args(ctx->c, in);
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    args.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
    args.topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
    args.handle = handle;
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    if (res.handle != handle)
        nt_fail(ctx, step, "result handle is not the given handle");
    check_dispatch(ctx, step, &res, 0);
}

/*
 * Combine rows from moe_combine_row, in the order the oracle received the tokens,
 * against moe_oracle_combine; with weights, the combined weights too.
 */
static void combine_check_at(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                             int with_weights, const char *step, void *x_at);

static void combine_check(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                          int with_weights, const char *step)
{
    combine_check_at(ctx, buffer, handle, with_weights, step, NULL);
}

/*
 * Combine from ranges registered with epx_buffer_register (read in place on the GPU,
 * copied on the CPU backend; the same values either way): two ranges in one allocation
 * (each peer opens the allocation once), x inside the second at an offset, then inside
 * the first; then both deregistered, and the memory freed.
 */
static void combine_registered_check(const nt_ctx_t *ctx, epx_buffer_t buffer,
                                     epx_handle_t handle)
{
    size_t rows_bytes = (size_t)(ctx->e->num_recv + 1) * (size_t)ctx->c->hidden * 2;
    size_t half = (rows_bytes + 1024 + 255) & ~(size_t)255;
    char *memory = mr_mem_alloc(2 * half, 0);
    CHECK_OK(epx_buffer_register(buffer, memory, half));
    CHECK_OK(epx_buffer_register(buffer, memory + half, half));
    combine_check_at(ctx, buffer, handle, 1, "combine from a registered range at an offset",
                     memory + half + 512);
    combine_check_at(ctx, buffer, handle, 0, "combine from a second registered range", memory);
    CHECK_OK(epx_buffer_deregister(buffer, memory + half));
    CHECK_OK(epx_buffer_deregister(buffer, memory));
    combine_check_at(ctx, buffer, handle, 1, "combine from deregistered memory (copied)",
                     memory + 512);
    mr_mem_free(memory);
}

/*
 * This rank's combine input under case `c`: for each received row, the row it sends back
 * (moe_combine_row), [num_recv, hidden] bf16 and one spare element; the caller frees it.
 */
static uint16_t *combine_input_rows(const moe_case_t *c, const nt_ctx_t *ctx)
{
    const moe_expected_t *e = ctx->e;
    uint16_t *rows = calloc((size_t)(e->num_recv * c->hidden) + 1, 2);
    CHECK(rows != NULL);
    for (int64_t i = 0; i < e->num_recv; i++)
        moe_combine_row(c, ctx->rank, e->recv_src_rank[i], e->recv_src_token[i],
                        rows + i * c->hidden);
    return rows;
}

/* x_at: where x goes (operation memory the caller owns), or NULL for a fresh tensor. */
static void combine_check_at(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                             int with_weights, const char *step, void *x_at)
{
    const moe_case_t *c = ctx->c;
    const moe_expected_t *e = ctx->e;
    int64_t hidden = c->hidden, n = ctx->in->num_tokens;
    int k = c->num_topk;
    uint16_t *rows = combine_input_rows(c, ctx);
    uint16_t *got = calloc((size_t)(n * hidden) + 1, 2);
    float *got_weights = calloc((size_t)(n * k) + 1, 4);
    CHECK(got != NULL && got_weights != NULL);

    void *x = x_at;
    if (x == NULL)
        x = mr_mem_from_host(rows, (size_t)(e->num_recv * hidden) * 2);
    else
        mr_mem_to_device(x, rows, (size_t)(e->num_recv * hidden) * 2);
    void *weights = mr_mem_from_host(e->recv_topk_weights, (size_t)(e->num_recv * k) * 4);
    void *out_x = mr_mem_alloc((size_t)(n * hidden) * 2, 0xff);
    void *out_weights = mr_mem_alloc((size_t)(n * k) * 4, 0xff);
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, e->num_recv, hidden);
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, hidden);
    if (with_weights) {
        args.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, e->num_recv, k);
        args.out_topk_weights = epx_tensor_2d(out_weights, EPX_DTYPE_FP32, n, k);
    }
    CHECK_OK(epx_combine(buffer, &args, NULL));

    uint16_t *want;
    CHECK_EQ_INT(moe_oracle_combine(c, ctx->rank, &want), 0);
    mr_mem_to_host(got, out_x, (size_t)(n * hidden) * 2);
    nt_check_bf16_rows(ctx, step, got, want, n, hidden);
    if (with_weights) {
        mr_mem_to_host(got_weights, out_weights, (size_t)(n * k) * 4);
        nt_check_combined_weights(ctx, step, got_weights);
    }
    free(want);
    free(rows);
    free(got);
    free(got_weights);
    if (x_at == NULL)
        mr_mem_free(x);
    mr_mem_free(weights);
    mr_mem_free(out_x);
    mr_mem_free(out_weights);
}

/*
 * Combine with DeepEP's two biases: out = bf16(bias0 + bias1 + the rows in rank order),
 * in fp32; across nodes the rows of each node are summed first (rank order, from 0) and
 * rounded to bf16, and those are added after the biases in node order (the oracle's
 * moe_oracle_combine_biased; docs/INTERNODE.md).
 */
static void combine_bias_check(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                               int cancelling)
{
    const char *step = cancelling ? "combine with two biases that cancel (+2^24, -2^24)"
                                  : "combine with two biases";
    const moe_case_t *c = ctx->c;
    const moe_expected_t *e = ctx->e;
    int64_t hidden = c->hidden, n = ctx->in->num_tokens;
    uint16_t *rows = combine_input_rows(c, ctx);
    uint16_t *bias = calloc((size_t)(2 * n * hidden) + 1, 2);
    uint16_t *got = calloc((size_t)(n * hidden) + 1, 2);
    CHECK(bias != NULL && got != NULL);
    /* Cancelling biases tell the order apart: added first they leave exactly 0 for the
     * rows; added after the rows, the fp32 sum next to 2^24 would keep only even
     * integers of them. */
    for (int64_t i = 0; i < 2 * n * hidden; i++)
        bias[i] = cancelling ? moe_float_to_bf16(i < n * hidden ? 16777216.0f : -16777216.0f)
                             : moe_float_to_bf16((float)((i * 7 + i / hidden * 31) % 17 - 8) *
                                                 0.25f);
    uint16_t *want = NULL;
    CHECK_EQ_INT(moe_oracle_combine_biased(c, ctx->rank, bias, bias + n * hidden, &want), 0);
    void *x = mr_mem_from_host(rows, (size_t)(e->num_recv * hidden) * 2 + 2);
    void *biases = mr_mem_from_host(bias, (size_t)(2 * n * hidden) * 2 + 2);
    void *out_x = mr_mem_alloc((size_t)(n * hidden) * 2 + 2, 0xff);
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, e->num_recv, hidden);
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, hidden);
    args.bias[0] = epx_tensor_2d(biases, EPX_DTYPE_BF16, n, hidden);
    args.bias[1] = epx_tensor_2d((uint16_t *)biases + n * hidden, EPX_DTYPE_BF16, n, hidden);
    CHECK_OK(epx_combine(buffer, &args, NULL));
    mr_mem_to_host(got, out_x, (size_t)(n * hidden) * 2);
    nt_check_bf16_rows(ctx, step, got, want, n, hidden);
    free(rows);
    free(bias);
    free(want);
    free(got);
    mr_mem_free(x);
    mr_mem_free(biases);
    mr_mem_free(out_x);
}

/*
 * Combine in DeepEP V2's order (order_topk_idx = the dispatch's top-k ids): the rows of
 * a token with three or more receivers cancel (+2^16 from the lowest, -2^16 from the
 * highest: the case's cancelling_rows), so the sum depends on the order of the additions
 * and the oracle's rank order and top-k order differ in places (counted: with random
 * routing on one node, every rank with 32 tokens or more, top-4 or more over 4 ranks or
 * more must see some; across nodes each node's partial is rounded to bf16, which hides
 * the small rows next to 2^16, so there the check is the oracle's bits only). The library
 * must give the top-k order's bits, with and without biases.
 */
static void combine_order_check(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                                void *topk_idx, int with_bias)
{
    const char *step = with_bias ? "combine in DeepEP V2's order, with biases"
                                 : "combine in DeepEP V2's order";
    moe_case_t c = *ctx->c;
    c.cancelling_rows = 1;
    const moe_expected_t *e = ctx->e;
    int64_t hidden = c.hidden, n = ctx->in->num_tokens;
    uint16_t *rows = combine_input_rows(&c, ctx);
    uint16_t *bias = calloc((size_t)(2 * n * hidden) + 1, 2);
    uint16_t *got = calloc((size_t)(n * hidden) + 1, 2);
    CHECK(bias != NULL && got != NULL);
    for (int64_t i = 0; i < 2 * n * hidden; i++)
        bias[i] = moe_float_to_bf16((float)((i * 5 + i / hidden * 13) % 11 - 5) * 0.125f);
    const uint16_t *bias0 = with_bias ? bias : NULL, *bias1 = with_bias ? bias + n * hidden : NULL;
    uint16_t *want = NULL, *ranked = NULL;
    CHECK_EQ_INT(moe_oracle_combine_ordered(&c, ctx->rank, bias0, bias1, 1, &want), 0);
    CHECK_EQ_INT(moe_oracle_combine_ordered(&c, ctx->rank, bias0, bias1, 0, &ranked), 0);
    int64_t differ = 0;
    for (int64_t i = 0; i < n * hidden; i++)
        differ += want[i] != ranked[i];
    int one_node = c.ranks_per_node == 0 || c.ranks_per_node == c.world_size;
    if (one_node && n >= 32 && c.world_size >= 4 && c.num_topk >= 4 &&
        c.routing == MOE_ROUTING_RANDOM)
        CHECK(differ > 0); /* the case tells the two orders apart */
    void *x = mr_mem_from_host(rows, (size_t)(e->num_recv * hidden) * 2 + 2);
    void *biases = mr_mem_from_host(bias, (size_t)(2 * n * hidden) * 2 + 2);
    void *out_x = mr_mem_alloc((size_t)(n * hidden) * 2 + 2, 0xff);
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, e->num_recv, hidden);
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, hidden);
    if (with_bias) {
        args.bias[0] = epx_tensor_2d(biases, EPX_DTYPE_BF16, n, hidden);
        args.bias[1] = epx_tensor_2d((uint16_t *)biases + n * hidden, EPX_DTYPE_BF16, n, hidden);
    }
    args.order_topk_idx = epx_tensor_2d(topk_idx, EPX_DTYPE_INT64, n, c.num_topk);
    /* The weights are summed in the same order (each entry from one rank: exact). */
    int k = c.num_topk;
    void *weights = mr_mem_from_host(e->recv_topk_weights, (size_t)(e->num_recv * k) * 4);
    void *out_weights = mr_mem_alloc((size_t)(n * k) * 4, 0xff);
    float *got_weights = calloc((size_t)(n * k) + 1, 4);
    CHECK(got_weights != NULL);
    args.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, e->num_recv, k);
    args.out_topk_weights = epx_tensor_2d(out_weights, EPX_DTYPE_FP32, n, k);
    CHECK_OK(epx_combine(buffer, &args, NULL));
    mr_mem_to_host(got, out_x, (size_t)(n * hidden) * 2);
    nt_check_bf16_rows(ctx, step, got, want, n, hidden);
    mr_mem_to_host(got_weights, out_weights, (size_t)(n * k) * 4);
    nt_check_combined_weights(ctx, step, got_weights);
    /* Args of the size before the field (epx 0.1's earlier layout): the field is not
     * read, so rank order. */
    args.size = offsetof(epx_combine_args_t, order_topk_idx);
    CHECK_OK(epx_combine(buffer, &args, NULL));
    mr_mem_to_host(got, out_x, (size_t)(n * hidden) * 2);
    nt_check_bf16_rows(ctx, with_bias ? "combine, args without order_topk_idx, with biases"
                                      : "combine, args without order_topk_idx",
                       got, ranked, n, hidden);
    free(got_weights);
    mr_mem_free(weights);
    mr_mem_free(out_weights);
    free(rows);
    free(bias);
    free(want);
    free(ranked);
    free(got);
    mr_mem_free(x);
    mr_mem_free(biases);
    mr_mem_free(out_x);
}

/*
 * Combine through the zero-copy input (epx_get_combine_input): the view has the
 * handle's rows (max_tokens * R when the host does not know them: worst-case mode on a
 * GPU) and is the same memory every time. The moe_combine_row rows are written into it
 * when `fill` (otherwise what an earlier fill left there must still be intact: no
 * dispatch writes the region) and the view itself is combine's x. Checked against
 * moe_oracle_combine, with top-k weights from a separate tensor.
 */
static void combine_view_check(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                               int64_t max_tokens, int fill, const char *step)
{
    const moe_case_t *c = ctx->c;
    const moe_expected_t *e = ctx->e;
    int64_t hidden = c->hidden, n = ctx->in->num_tokens;
    int k = c->num_topk;
    epx_tensor_t view = EPX_TENSOR_NONE, again = EPX_TENSOR_NONE;
    CHECK_OK(epx_get_combine_input(buffer, handle, &view));
    CHECK_OK(epx_get_combine_input(buffer, handle, &again));
    epx_handle_info_t info = EPX_HANDLE_INFO_INIT;
    CHECK_OK(epx_handle_get_info(handle, &info));
    int64_t rows = info.num_recv_tokens >= 0 ? info.num_recv_tokens : max_tokens * c->world_size;
    if (view.data == NULL || view.dtype != EPX_DTYPE_BF16 || view.ndim != 2 ||
        view.shape[0] != rows || view.shape[1] != hidden ||
        (view.strides[0] != 0 && view.strides[0] != hidden))
        nt_fail(ctx, step, "combine input view is %p %s [%lld, %lld] (ndim %d, row stride "
                "%lld), expected bf16 [%lld, %lld] contiguous",
                view.data, epx_dtype_name(view.dtype), (long long)view.shape[0],
                (long long)view.shape[1], view.ndim, (long long)view.strides[0],
                (long long)rows, (long long)hidden);
    if (again.data != view.data || again.shape[0] != view.shape[0])
        nt_fail(ctx, step, "a second epx_get_combine_input gave %p [%lld], the first %p [%lld]",
                again.data, (long long)again.shape[0], view.data, (long long)view.shape[0]);

    uint16_t *x_rows = combine_input_rows(c, ctx);
    float *weight_rows = calloc((size_t)(rows * k) + 1, 4);
    uint16_t *got = calloc((size_t)(n * hidden) + 1, 2);
    float *got_weights = calloc((size_t)(n * k) + 1, 4);
    CHECK(weight_rows != NULL && got != NULL && got_weights != NULL);
    if (fill)
        mr_mem_to_device(view.data, x_rows, (size_t)(e->num_recv * hidden) * 2);
    /* Weights have x's rows; rows past the received ones are never read. */
    memcpy(weight_rows, e->recv_topk_weights, (size_t)(e->num_recv * k) * 4);

    void *weights = mr_mem_from_host(weight_rows, (size_t)(rows * k) * 4);
    void *out_x = mr_mem_alloc((size_t)(n * hidden) * 2, 0xff);
    void *out_weights = mr_mem_alloc((size_t)(n * k) * 4, 0xff);
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = view;
    args.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, rows, k);
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, hidden);
    args.out_topk_weights = epx_tensor_2d(out_weights, EPX_DTYPE_FP32, n, k);
    CHECK_OK(epx_combine(buffer, &args, NULL));

    uint16_t *want;
    CHECK_EQ_INT(moe_oracle_combine(c, ctx->rank, &want), 0);
    mr_mem_to_host(got, out_x, (size_t)(n * hidden) * 2);
    nt_check_bf16_rows(ctx, step, got, want, n, hidden);
    mr_mem_to_host(got_weights, out_weights, (size_t)(n * k) * 4);
    nt_check_combined_weights(ctx, step, got_weights);
    free(want);
    free(x_rows);
    free(weight_rows);
    free(got);
    free(got_weights);
    mr_mem_free(weights);
    mr_mem_free(out_x);
    mr_mem_free(out_weights);
}

/*
 * Combine of the dispatched rows themselves (bf16): every token comes back as itself
 * times the number of ranks that received it, summed node by node (moe_case.h): each
 * node's partial x * (its receivers) is exact in fp32 and rounded to bf16, and the
 * partials are added in node order. On one node: bf16(x * receivers).
 */
static void roundtrip_check(const nt_ctx_t *ctx, epx_buffer_t buffer, epx_handle_t handle,
                            void *recv_x)
{
    const char *step = "combine(dispatch(x))";
    const moe_case_t *c = ctx->c;
    int64_t hidden = c->hidden, n = ctx->in->num_tokens;
    void *out_x = mr_mem_alloc((size_t)(n * hidden) * 2, 0xff);
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = epx_tensor_2d(recv_x, EPX_DTYPE_BF16, ctx->e->num_recv, hidden);
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, hidden);
    CHECK_OK(epx_combine(buffer, &args, NULL));

    uint16_t *got = calloc((size_t)(n * hidden) + 1, 2);
    uint16_t *want = calloc((size_t)(n * hidden) + 1, 2);
    CHECK(got != NULL && want != NULL);
    mr_mem_to_host(got, out_x, (size_t)(n * hidden) * 2);
    int world = c->world_size;
    int per_node = c->ranks_per_node > 0 ? c->ranks_per_node : world;
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < hidden; i++) {
            float x = moe_bf16_to_float(((const uint16_t *)ctx->in->x)[t * hidden + i]);
            float total = 0.0f;
            for (int node = 0; node < world / per_node; node++) {
                int receivers = 0;
                for (int r = node * per_node; r < (node + 1) * per_node; r++)
                    receivers += ctx->e->is_token_in_rank[t * world + r];
                if (receivers > 0)
                    total += moe_bf16_to_float(moe_float_to_bf16(x * (float)receivers));
            }
            want[t * hidden + i] = moe_float_to_bf16(total);
        }
    nt_check_bf16_rows(ctx, step, got, want, n, hidden);
    free(got);
    free(want);
    mr_mem_free(out_x);
}

/*
 * The handle's rank_prefix_matrix: [s][r] = tokens ranks 0..s send to r, from every
 * rank's oracle layout (num_tokens_per_rank of rank s = what s sends to each rank).
 */
static void check_rank_prefix(const nt_ctx_t *ctx, epx_handle_t handle, const char *step)
{
    const moe_case_t *c = ctx->c;
    int world = c->world_size;
    epx_tensor_t matrix;
    CHECK_OK(epx_handle_get_rank_prefix_matrix(handle, &matrix));
    if (matrix.dtype != EPX_DTYPE_INT32 || matrix.ndim != 2 || matrix.shape[0] != world ||
        matrix.shape[1] != world)
        nt_fail(ctx, step, "rank_prefix_matrix is %s [%lld, %lld], expected int32 [%d, %d]",
                epx_dtype_name(matrix.dtype), (long long)matrix.shape[0],
                (long long)matrix.shape[1], world, world);
    int32_t *got = calloc((size_t)world * world, sizeof(int32_t));
    int32_t *sums = calloc((size_t)world, sizeof(int32_t));
    CHECK(got != NULL && sums != NULL);
    /* The matrix is device memory on the GPU backend, after this rank's dispatch. */
    mr_mem_to_host(got, matrix.data, (size_t)world * world * sizeof(int32_t));
    for (int src = 0; src < world; src++) {
        moe_expected_t es;
        CHECK_EQ_INT(moe_oracle_dispatch(c, src, &es), 0);
        for (int r = 0; r < world; r++) {
            sums[r] += es.num_tokens_per_rank[r];
            if (got[src * world + r] != sums[r])
                nt_fail(ctx, step, "rank_prefix_matrix[%d][%d] is %d, expected %d", src, r,
                        got[src * world + r], sums[r]);
        }
        moe_expected_free(&es);
    }
    free(got);
    free(sums);
}

/*
 * Fresh dispatch routed by the layout (is_token_in_rank and num_tokens_per_expert, as
 * DeepEP's dispatch without top-k): the same rows and per-expert counts as the top-k
 * routing, no top-k outputs; then its combine (rows and handle work as any other).
 */
static void dispatch_by_layout(const nt_ctx_t *ctx, epx_buffer_t buffer, const inputs_t *in)
{
    const moe_case_t *c = ctx->c;
    const char *step = "fresh dispatch routed by the layout";
    int64_t n = in->host.num_tokens;
    int world = c->world_size;
    void *in_rank = mr_mem_from_host(ctx->e->is_token_in_rank, n > 0 ? (size_t)(n * world) : 1);
    void *per_expert = mr_mem_from_host(ctx->e->num_tokens_per_expert,
                                        (size_t)c->num_experts * sizeof(int32_t));
    epx_dispatch_args_t args = dispatch_args(c, in);
    args.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
    args.topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
    args.is_token_in_rank = epx_tensor_2d(in_rank, EPX_DTYPE_BOOL, n, world);
    args.num_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, c->num_experts);
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    check_dispatch(ctx, step, &res, 0);
    check_rank_prefix(ctx, res.handle, step);
    combine_check(ctx, buffer, res.handle, 0, "combine of a dispatch routed by the layout");
    CHECK_OK(epx_handle_destroy(res.handle));
    mr_mem_free(in_rank);
    mr_mem_free(per_expert);
}

/* fp8 x with column-major x_scales ([tokens, S], strides [1, tokens]): the same results. */
static void dispatch_column_major_scales(const nt_ctx_t *ctx, epx_buffer_t buffer,
                                         const inputs_t *in)
{
    const moe_case_t *c = ctx->c;
    int64_t n = in->host.num_tokens, cols = c->hidden / 128;
    float *transposed = calloc((size_t)(n * cols) + 1, sizeof(float));
    CHECK(transposed != NULL);
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < cols; i++)
            transposed[i * n + t] = in->host.x_scales[t * cols + i];
    void *scales = mr_mem_from_host(transposed, (size_t)(n * cols + 1) * sizeof(float));
    epx_dispatch_args_t args = dispatch_args(c, in);
    args.x_scales = epx_tensor_2d(scales, EPX_DTYPE_FP32, n, cols);
    args.x_scales.strides[0] = 1;
    args.x_scales.strides[1] = n > 1 ? n : 2;
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    check_dispatch(ctx, "fresh dispatch, column-major x_scales", &res, 1);
    CHECK_OK(epx_handle_destroy(res.handle));
    mr_mem_free(scales);
    free(transposed);
}

/* ---------------------------------------------------------------- one case */

/*
 * Across nodes the fan-out copy (tool support, for ranks that map each other's memory) is
 * refused, on this rank alone.
 */
static void check_fanout_refused_across_nodes(epx_group_t group,
                                              const epx_buffer_config_t *config)
{
    epx_buffer_t buffer;
    void *x = mr_mem_alloc(16, 0);
    CHECK_OK(epx_buffer_create(group, config, &buffer));
    /* The fan-out copy (tool support) is for ranks that map each other's memory: refused
     * on this rank alone, before any exchange, with no effect on the buffer. */
    epx_fanout_args_t fanout = EPX_FANOUT_ARGS_INIT;
    fanout.src = x;
    fanout.rows = 1;
    fanout.row_bytes = 16;
    CHECK_STATUS(epx_fanout_copy(buffer, &fanout, NULL), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("the group spans nodes");
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(x);
}

/*
 * The CUDA backend across nodes refuses combine's order_topk_idx (on every rank alike, so
 * nobody waits); the buffer is failed by it, so this runs on a buffer of its own.
 */
static void check_order_refused_across_nodes(const nt_ctx_t *ctx, epx_group_t group,
                                             const epx_buffer_config_t *config,
                                             const inputs_t *in)
{
    const moe_case_t *c = ctx->c;
    int64_t n = in->host.num_tokens;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, config, &buffer));
    epx_dispatch_args_t dargs = dispatch_args(c, in);
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &dargs, &res, NULL));
    void *out_x = mr_mem_alloc((size_t)(n * c->hidden) * 2 + 2, 0);
    epx_tensor_t x;
    CHECK_OK(epx_get_combine_input(buffer, res.handle, &x));
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = res.handle;
    args.x = x;
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, c->hidden);
    args.order_topk_idx = epx_tensor_2d(in->idx, EPX_DTYPE_INT64, n, c->num_topk);
    CHECK_STATUS(epx_combine(buffer, &args, NULL), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("across nodes");
    CHECK_OK(epx_handle_destroy(res.handle));
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(out_x);
}

/* The first round: every way of calling dispatch and combine, on buffer `buffer`. */
static void run_full_round(const nt_ctx_t *ctx, epx_buffer_t buffer, const inputs_t *in,
                           int64_t max_tokens, int order_supported)
{
    const moe_case_t *c = ctx->c;
    outputs_t exact, worst;

    check_layout(ctx, buffer, in);
    epx_handle_t views = dispatch_fresh_views(ctx, buffer, in, "fresh dispatch (views)");
    check_rank_prefix(ctx, views, "fresh dispatch (views)");
    /* One spare row: outputs only need to be at least as large as what arrives. */
    epx_handle_t owned = dispatch_fresh_outputs(ctx, buffer, in, ctx->e->num_recv + 1, 0,
                                                &exact, "fresh dispatch (caller outputs)");
    combine_check(ctx, buffer, views, 1, "combine with weights");
    combine_check(ctx, buffer, views, 0, "combine without weights");
    combine_registered_check(ctx, buffer, views);
    combine_bias_check(ctx, buffer, views, 0);
    combine_bias_check(ctx, buffer, views, 1);
    if (order_supported) {
        combine_order_check(ctx, buffer, views, in->idx, 0);
        combine_order_check(ctx, buffer, views, in->idx, 1);
    }
    if (c->dtype == EPX_DTYPE_BF16)
        roundtrip_check(ctx, buffer, owned, exact.x);
    combine_view_check(ctx, buffer, views, max_tokens, 1, "combine through the input view");
    dispatch_cached(ctx, buffer, in, views);
    /* No dispatch writes the view: the rows written above are still there. (A combine
     * from other memory may: the host backend stages such an x in the same rows.) */
    combine_view_check(ctx, buffer, views, max_tokens, 0,
                       "combine through the input view after a cached dispatch, not rewritten");
    combine_check(ctx, buffer, views, 1, "combine after cached dispatch");
    check_rank_prefix(ctx, views, "after a cached dispatch");
    dispatch_by_layout(ctx, buffer, in);
    if (c->dtype == EPX_DTYPE_FP8_E4M3)
        dispatch_column_major_scales(ctx, buffer, in);

    epx_handle_t worst_handle =
        dispatch_fresh_outputs(ctx, buffer, in, max_tokens * c->world_size,
                               EPX_DISPATCH_WORST_CASE, &worst, "worst-case dispatch");
    combine_check(ctx, buffer, worst_handle, 1, "combine of worst-case dispatch");
    check_rank_prefix(ctx, worst_handle, "worst-case dispatch");
    combine_view_check(ctx, buffer, worst_handle, max_tokens, 1,
                       "combine of worst-case dispatch through the input view");

    CHECK_OK(epx_handle_destroy(worst_handle));
    CHECK_OK(epx_handle_destroy(owned));
    CHECK_OK(epx_handle_destroy(views));
    outputs_free(&exact);
    outputs_free(&worst);
}

static void run_case(epx_group_t group, const epx_group_info_t *info, int index)
{
    const normal_case_t *nc = &cases[index];
    double start = mr_now_ms();
    moe_case_t c = make_case(nc, info, index, 0);
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = nc->max_tokens;
    config.hidden = c.hidden;
    config.num_experts = c.num_experts;
    config.num_topk = c.num_topk;
    config.dispatch_dtype = c.dtype;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));

    /* Later rounds reuse the buffer with new routing and values. */
    for (int round = 0; round < NUM_ROUNDS; round++) {
        c = make_case(nc, info, index, round);
        inputs_t in;
        moe_expected_t e;
        char step[64];
        inputs_make(&c, info->rank, &in);
        CHECK_EQ_INT(moe_oracle_dispatch(&c, info->rank, &e), 0);
        nt_ctx_t ctx = {nc->name, info->rank, &c, &e, &in.host};
        if (round == 0) {
            /* DeepEP V2's summation order: not yet across nodes on the CUDA backend. */
            int spans = info->ranks_per_node < info->world_size;
            int order_supported = !(spans && info->backend == EPX_BACKEND_CUDA);
            run_full_round(&ctx, buffer, &in, nc->max_tokens, order_supported);
            if (spans && index == 0)
                check_fanout_refused_across_nodes(group, &config);
            if (!order_supported && index == 0)
                check_order_refused_across_nodes(&ctx, group, &config, &in);
        } else {
            snprintf(step, sizeof step, "round %d dispatch", round);
            epx_handle_t handle = dispatch_fresh_views(&ctx, buffer, &in, step);
            snprintf(step, sizeof step, "round %d combine", round);
            combine_check(&ctx, buffer, handle, 1, step);
            snprintf(step, sizeof step, "round %d combine through the input view", round);
            combine_view_check(&ctx, buffer, handle, nc->max_tokens, 1, step);
            CHECK_OK(epx_handle_destroy(handle));
        }
        moe_expected_free(&e);
        inputs_free(&in);
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    /* Rank 0 reports a case only once every rank got through it. */
    CHECK_OK(epx_group_barrier(group));
    if (info->rank == 0)
        printf("test_normal: %-15s ok (%d ranks, %d node(s) of %d, %s backend, %d experts, "
               "top-%d, %.0f ms)\n",
               nc->name, info->world_size, info->world_size / info->ranks_per_node,
               info->ranks_per_node, epx_backend_name(info->backend), c.num_experts,
               c.num_topk, mr_now_ms() - start);
}

/* epx_group_allgather: rank i's record lands at index i on every rank. */
static void check_group_allgather(epx_group_t group, const epx_group_info_t *info)
{
    int world = info->world_size;
    int64_t mine[2] = {1000 + info->rank, -(int64_t)info->rank * 7};
    int64_t *all = calloc((size_t)world * 2, sizeof(int64_t));
    CHECK(all != NULL);
    CHECK_OK(epx_group_allgather(group, mine, all, sizeof(mine)));
    for (int r = 0; r < world; r++) {
        CHECK_EQ_INT(all[2 * r], 1000 + r);
        CHECK_EQ_INT(all[2 * r + 1], -(int64_t)r * 7);
    }
    free(all);
}

int main(int argc, char **argv)
{
    const char *name = mr_flag(argc, argv, "--case", "all");
    int found = 0;
    for (int i = 0; i < NUM_CASES; i++)
        found |= strcmp(name, "all") == 0 || strcmp(name, cases[i].name) == 0;
    if (!found) {
        fprintf(stderr, "test_normal: no case named %s; cases:", name);
        for (int i = 0; i < NUM_CASES; i++)
            fprintf(stderr, " %s", cases[i].name);
        fprintf(stderr, "\n");
        return 2;
    }

    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx_group_t group = mr_group_create(argc, argv, &info);
    check_group_allgather(group, &info);
    for (int i = 0; i < NUM_CASES; i++)
        if (strcmp(name, "all") == 0 || strcmp(name, cases[i].name) == 0)
            run_case(group, &info, i);
    CHECK_OK(epx_group_destroy(group));
    return 0;
}
