/*
 * Rejected combine arguments, combine-input views, buffer configs and handle calls
 * (test_bad_input, one rank).
 */
#include <stdio.h>
#include <string.h>

#include "bad_input.h"
#include "mem.h"
#include "test_util.h"

#define INVALID EPX_ERR_INVALID_ARG

/* A fresh buffer after one good dispatch, and valid combine arguments for it. */
typedef struct {
    bi_fixture_t f;
    int64_t num_recv;
    void *x, *weights, *out_x, *out_weights;
    epx_combine_args_t args;
} combine_fixture_t;

static void combine_setup(combine_fixture_t *cf)
{
    bi_fixture_t *f = &cf->f;
    int k = BI_TOPK;
    bi_setup(f, EPX_DTYPE_BF16, BI_TOKENS);
    CHECK_OK(epx_dispatch(f->buffer, &f->args, &f->result, NULL));
    cf->num_recv = f->result.num_recv_tokens;
    /* One spare row each, so the row-count cases below stay inside the memory. */
    cf->x = mr_mem_alloc((size_t)((cf->num_recv + 1) * BI_HIDDEN) * 2, 0);
    cf->weights = mr_mem_alloc((size_t)((cf->num_recv + 1) * k) * 4, 0);
    cf->out_x = mr_mem_alloc((size_t)((BI_TOKENS + 1) * BI_HIDDEN) * 2, 0);
    cf->out_weights = mr_mem_alloc((size_t)((BI_TOKENS + 1) * k) * 4, 0);
    cf->args = (epx_combine_args_t)EPX_COMBINE_ARGS_INIT;
    cf->args.handle = f->result.handle;
    cf->args.x = epx_tensor_2d(cf->x, EPX_DTYPE_BF16, cf->num_recv, BI_HIDDEN);
    cf->args.topk_weights = epx_tensor_2d(cf->weights, EPX_DTYPE_FP32, cf->num_recv, k);
    cf->args.out_x = epx_tensor_2d(cf->out_x, EPX_DTYPE_BF16, BI_TOKENS, BI_HIDDEN);
    cf->args.out_topk_weights = epx_tensor_2d(cf->out_weights, EPX_DTYPE_FP32, BI_TOKENS, k);
}

static void combine_teardown(combine_fixture_t *cf)
{
    CHECK_OK(epx_handle_destroy(cf->f.result.handle));
    mr_mem_free(cf->x);
    mr_mem_free(cf->weights);
    mr_mem_free(cf->out_x);
    mr_mem_free(cf->out_weights);
    bi_teardown(&cf->f);
}

static void no_handle(epx_combine_args_t *a) { a->handle = NULL; }
static void size_wrong(epx_combine_args_t *a) { a->size = 0; }
static void x_extra_row(epx_combine_args_t *a) { a->x.shape[0] += 1; }
static void x_missing_row(epx_combine_args_t *a) { a->x.shape[0] -= 1; }
static void x_dtype(epx_combine_args_t *a) { a->x.dtype = EPX_DTYPE_FP32; }
static void x_hidden(epx_combine_args_t *a) { a->x.shape[1] = BI_HIDDEN + 128; }
static void out_rows(epx_combine_args_t *a) { a->out_x.shape[0] += 1; }
static void out_dtype(epx_combine_args_t *a) { a->out_x.dtype = EPX_DTYPE_FP32; }
static void out_missing(epx_combine_args_t *a) { a->out_x = (epx_tensor_t)EPX_TENSOR_NONE; }
static void no_out_weights(epx_combine_args_t *a)
{
    a->out_topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
}
static void no_weights(epx_combine_args_t *a) { a->topk_weights = (epx_tensor_t)EPX_TENSOR_NONE; }
static void weights_rows(epx_combine_args_t *a) { a->topk_weights.shape[0] += 1; }
static void out_weights_cols(epx_combine_args_t *a) { a->out_topk_weights.shape[1] += 1; }
/* bias[j] over out_x's memory with a wrong shape or dtype (never read: refused first). */
static void bias0_rows(epx_combine_args_t *a)
{
    a->bias[0] = a->out_x;
    a->bias[0].shape[0] -= 1;
}
static void bias1_dtype(epx_combine_args_t *a)
{
    a->bias[1] = a->out_x;
    a->bias[1].dtype = EPX_DTYPE_FP32;
}
static void bias0_hidden(epx_combine_args_t *a)
{
    a->bias[0] = a->out_x;
    a->bias[0].shape[1] = BI_HIDDEN / 2;
}
/* order_topk_idx over out_topk_weights' memory (never read: refused first). */
static void order_dtype(epx_combine_args_t *a) { a->order_topk_idx = a->out_topk_weights; }
static void order_columns(epx_combine_args_t *a)
{
    a->order_topk_idx = a->out_topk_weights;
    a->order_topk_idx.dtype = EPX_DTYPE_INT64;
    a->order_topk_idx.shape[1] += 1;
}

typedef struct {
    const char *what;
    void (*mutate)(epx_combine_args_t *args);
    const char *culprit;
} combine_case_t;

static const combine_case_t combine_cases[] = {
    {"combine: args.size wrong", size_wrong, "size"},
    {"combine: no handle", no_handle, "handle"},
    {"combine: x rows > handle's received", x_extra_row, "x"},
    {"combine: x rows < handle's received", x_missing_row, "x"},
    {"combine: x dtype fp32", x_dtype, "x"},
    {"combine: x hidden wrong", x_hidden, "x"},
    {"combine: out_x rows != dispatch tokens", out_rows, "out_x"},
    {"combine: out_x dtype fp32", out_dtype, "out_x"},
    {"combine: out_x not given", out_missing, "out_x"},
    {"combine: topk_weights without output", no_out_weights, "out_topk_weights"},
    {"combine: out_topk_weights without input", no_weights, "out_topk_weights"},
    {"combine: topk_weights rows wrong", weights_rows, "topk_weights"},
    {"combine: out_topk_weights columns wrong", out_weights_cols, "out_topk_weights"},
    {"combine: bias[0] rows != dispatch tokens", bias0_rows, "bias"},
    {"combine: bias[1] dtype fp32", bias1_dtype, "bias"},
    {"combine: bias[0] hidden wrong", bias0_hidden, "bias"},
    {"combine: order_topk_idx dtype fp32", order_dtype, "order_topk_idx"},
    {"combine: order_topk_idx columns != num_topk", order_columns, "order_topk_idx"},
};

/* Handles belong to the buffer that made them. */
static void run_foreign_handle_cases(void)
{
    combine_fixture_t cf;
    bi_fixture_t other;
    combine_setup(&cf);
    bi_setup(&other, EPX_DTYPE_BF16, BI_TOKENS);
    bi_expect("combine: handle from another buffer", epx_combine(other.buffer, &cf.args, NULL),
              INVALID, "handle");
    combine_teardown(&cf);
    bi_teardown(&other);

    combine_setup(&cf);
    bi_setup(&other, EPX_DTYPE_BF16, BI_TOKENS);
    other.args.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
    other.args.topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
    other.args.handle = cf.args.handle;
    bi_expect("cached dispatch: handle from another buffer",
              epx_dispatch(other.buffer, &other.args, &other.result, NULL), INVALID, "handle");
    combine_teardown(&cf);
    bi_teardown(&other);
}

/*
 * epx_get_combine_input: local, so a rejection leaves the buffer usable; a handle only
 * opens a view of the buffer that made it.
 */
static void run_combine_input_cases(void)
{
    combine_fixture_t cf;
    bi_fixture_t other;
    epx_tensor_t view = EPX_TENSOR_NONE;
    combine_setup(&cf);
    bi_setup(&other, EPX_DTYPE_BF16, BI_TOKENS);
    bi_expect("get_combine_input: NULL buffer",
              epx_get_combine_input(NULL, cf.args.handle, &view), INVALID, "buffer");
    bi_expect("get_combine_input: NULL handle", epx_get_combine_input(cf.f.buffer, NULL, &view),
              INVALID, "handle");
    bi_expect("get_combine_input: NULL x",
              epx_get_combine_input(cf.f.buffer, cf.args.handle, NULL), INVALID, "x");
    bi_expect("get_combine_input: handle from another buffer",
              epx_get_combine_input(other.buffer, cf.args.handle, &view), INVALID, "handle");
    CHECK(view.data == NULL); /* outputs are written only on success */

    /* None of that poisoned the buffer: the view opens and combine reads through it. */
    CHECK_OK(epx_get_combine_input(cf.f.buffer, cf.args.handle, &view));
    CHECK(view.data != NULL && view.dtype == EPX_DTYPE_BF16 && view.ndim == 2);
    CHECK_EQ_INT(view.shape[0], cf.num_recv);
    CHECK_EQ_INT(view.shape[1], BI_HIDDEN);
    cf.args.x = view;
    CHECK_OK(epx_combine(cf.f.buffer, &cf.args, NULL));
    combine_teardown(&cf);
    bi_teardown(&other);
}

void bi_run_combine_cases(void)
{
    combine_fixture_t cf;
    combine_setup(&cf);
    bi_expect("combine: NULL buffer", epx_combine(NULL, &cf.args, NULL), INVALID, "buffer");
    bi_expect("combine: NULL args", epx_combine(cf.f.buffer, NULL, NULL), INVALID, "args");
    combine_teardown(&cf);

    for (size_t i = 0; i < sizeof combine_cases / sizeof combine_cases[0]; i++) {
        combine_setup(&cf);
        combine_cases[i].mutate(&cf.args);
        bi_expect(combine_cases[i].what, epx_combine(cf.f.buffer, &cf.args, NULL), INVALID,
                  combine_cases[i].culprit);
        combine_teardown(&cf);
    }
    run_foreign_handle_cases();
    run_combine_input_cases();

    /* The unbroken arguments combine. */
    combine_setup(&cf);
    CHECK_OK(epx_combine(cf.f.buffer, &cf.args, NULL));
    epx_handle_info_t info = EPX_HANDLE_INFO_INIT;
    bi_expect("handle_get_info: NULL handle", epx_handle_get_info(NULL, &info), INVALID,
              "handle");
    bi_expect("handle_get_info: NULL info", epx_handle_get_info(cf.args.handle, NULL), INVALID,
              "info");
    info.size = sizeof(info) + 8;
    bi_expect("handle_get_info: bad info.size", epx_handle_get_info(cf.args.handle, &info),
              INVALID, "EPX_HANDLE_INFO_INIT");
    CHECK_EQ_INT(info.num_tokens, 0); /* nothing written on a refusal */
    bi_expect("handle_get_rank_prefix_matrix: NULL matrix",
              epx_handle_get_rank_prefix_matrix(cf.args.handle, NULL), INVALID, "matrix");
    CHECK_ERROR_MENTIONS("matrix is NULL");
    bi_expect("handle_destroy: NULL handle", epx_handle_destroy(NULL), INVALID, "handle");
    CHECK_ERROR_MENTIONS("handle is NULL");
    bi_expect("get_async_error: NULL error", epx_get_async_error(cf.f.buffer, NULL, NULL, 0),
              INVALID, "error");
    CHECK_ERROR_MENTIONS("error is NULL");
    info.size = sizeof(info);
    CHECK_OK(epx_handle_get_info(cf.args.handle, &info));
    CHECK_EQ_INT(info.num_tokens, BI_TOKENS);
    CHECK_EQ_INT(info.num_recv_tokens, cf.num_recv);
    combine_teardown(&cf);
}

/* ---------------------------------------------------------------- buffer config */

static void size_field(epx_buffer_config_t *c) { c->size = sizeof *c + 4; } /* smaller sizes may be earlier versions, accepted */
static void zero_tokens(epx_buffer_config_t *c) { c->max_tokens_per_rank = 0; }
static void negative_tokens(epx_buffer_config_t *c) { c->max_tokens_per_rank = -5; }
static void zero_hidden(epx_buffer_config_t *c) { c->hidden = 0; }
static void fp8_hidden(epx_buffer_config_t *c)
{
    c->dispatch_dtype = EPX_DTYPE_FP8_E4M3;
    c->hidden = 200;
}
static void dtype_invalid(epx_buffer_config_t *c) { c->dispatch_dtype = EPX_DTYPE_INVALID; }
static void dtype_fp32(epx_buffer_config_t *c) { c->dispatch_dtype = EPX_DTYPE_FP32; }
static void zero_experts(epx_buffer_config_t *c) { c->num_experts = 0; }
static void zero_topk(epx_buffer_config_t *c) { c->num_topk = 0; }
static void topk_above_experts(epx_buffer_config_t *c) { c->num_topk = c->num_experts + 1; }
static void negative_sms(epx_buffer_config_t *c) { c->num_sms = -1; }

typedef struct {
    const char *what;
    void (*mutate)(epx_buffer_config_t *config);
    const char *culprit;
} config_case_t;

static const config_case_t config_cases[] = {
    {"config.size wrong", size_field, "size"},
    {"max_tokens_per_rank 0", zero_tokens, "max_tokens_per_rank"},
    {"max_tokens_per_rank -5", negative_tokens, "max_tokens_per_rank"},
    {"hidden 0", zero_hidden, "hidden"},
    {"fp8 with hidden 200 (not a multiple of 128)", fp8_hidden, "hidden"},
    {"dispatch_dtype invalid", dtype_invalid, "dispatch_dtype"},
    {"dispatch_dtype fp32", dtype_fp32, "dispatch_dtype"},
    {"num_experts 0", zero_experts, "num_experts"},
    {"num_topk 0", zero_topk, "num_topk"},
    {"num_topk > num_experts", topk_above_experts, "num_topk"},
    {"num_sms -1", negative_sms, "num_sms"},
};

static epx_buffer_config_t good_config(void)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = BI_HIDDEN;
    config.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size;
    config.num_topk = BI_TOPK;
    return config;
}

void bi_run_config_cases(void)
{
    char what[128];
    size_t bytes = 0, more_bytes = 0;
    epx_buffer_t buffer = NULL;
    for (size_t i = 0; i < sizeof config_cases / sizeof config_cases[0]; i++) {
        epx_buffer_config_t config = good_config();
        config_cases[i].mutate(&config);
        snprintf(what, sizeof what, "buffer_size: %s", config_cases[i].what);
        bi_expect(what, epx_buffer_size(bi_group, &config, &bytes), INVALID,
                  config_cases[i].culprit);
        snprintf(what, sizeof what, "buffer_create: %s", config_cases[i].what);
        bi_expect(what, epx_buffer_create(bi_group, &config, &buffer), INVALID,
                  config_cases[i].culprit);
        CHECK(buffer == NULL);
    }

    /* Rows move as 16-byte vectors: hidden 100 (above 0, not fp8) is still refused. */
    epx_buffer_config_t config = good_config();
    config.hidden = 100;
    bi_expect("buffer_size: hidden 100 (not a multiple of 8)",
              epx_buffer_size(bi_group, &config, &bytes), INVALID, "hidden");
    CHECK_ERROR_MENTIONS("multiple of 8");
    bi_expect("buffer_create: hidden 100 (not a multiple of 8)",
              epx_buffer_create(bi_group, &config, &buffer), INVALID, "hidden");
    CHECK_ERROR_MENTIONS("multiple of 8");
    CHECK(buffer == NULL);

    config = good_config();
    bi_expect("buffer_size: NULL group", epx_buffer_size(NULL, &config, &bytes), INVALID,
              "group");
    bi_expect("buffer_size: NULL config", epx_buffer_size(bi_group, NULL, &bytes), INVALID,
              "config");
    bi_expect("buffer_size: NULL bytes_per_rank", epx_buffer_size(bi_group, &config, NULL),
              INVALID, "bytes_per_rank");
    bi_expect("buffer_create: NULL group", epx_buffer_create(NULL, &config, &buffer), INVALID,
              "group");
    bi_expect("buffer_create: NULL config", epx_buffer_create(bi_group, NULL, &buffer),
              INVALID, "config");
    bi_expect("buffer_create: NULL buffer", epx_buffer_create(bi_group, &config, NULL),
              INVALID, "buffer");
    bi_expect("buffer_destroy: NULL buffer", epx_buffer_destroy(NULL), INVALID, "buffer");

    /* A good config has a size, and more tokens take more memory (many more: the CUDA
     * backend rounds a small shared allocation up to 2 MiB). */
    CHECK_OK(epx_buffer_size(bi_group, &config, &bytes));
    config.max_tokens_per_rank *= 1024;
    CHECK_OK(epx_buffer_size(bi_group, &config, &more_bytes));
    CHECK(bytes > 0 && more_bytes > bytes);
}
