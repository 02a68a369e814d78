/*
 * Rejected dispatch and layout arguments (test_bad_input, one rank). Each case starts
 * from valid arguments on a fresh buffer and breaks one thing.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "bad_input.h"
#include "mem.h"
#include "test_util.h"

/* Attach caller outputs of `rows` rows (all four, as dispatch wants them). */
static void attach_outputs(bi_fixture_t *f, int64_t rows)
{
    int k = BI_TOPK;
    f->outputs[0] = mr_mem_alloc((size_t)(rows * BI_HIDDEN) * epx_dtype_size(f->c.dtype), 0);
    f->outputs[1] = mr_mem_alloc((size_t)(rows * (BI_HIDDEN / 128)) * 4, 0);
    f->outputs[2] = mr_mem_alloc((size_t)(rows * k) * 8, 0);
    f->outputs[3] = mr_mem_alloc((size_t)(rows * k) * 4, 0);
    f->args.recv_x = epx_tensor_2d(f->outputs[0], f->c.dtype, rows, BI_HIDDEN);
    if (f->c.dtype == EPX_DTYPE_FP8_E4M3)
        f->args.recv_x_scales =
            epx_tensor_2d(f->outputs[1], EPX_DTYPE_FP32, rows, BI_HIDDEN / 128);
    f->args.recv_topk_idx = epx_tensor_2d(f->outputs[2], EPX_DTYPE_INT64, rows, k);
    f->args.recv_topk_weights = epx_tensor_2d(f->outputs[3], EPX_DTYPE_FP32, rows, k);
}

static void args_size(bi_fixture_t *f) { f->args.size -= 8; }
static void result_size(bi_fixture_t *f) { f->result.size += 8; }
static void x_dtype_fp32(bi_fixture_t *f) { f->args.x.dtype = EPX_DTYPE_FP32; }
static void x_dtype_int64(bi_fixture_t *f) { f->args.x.dtype = EPX_DTYPE_INT64; }
static void x_hidden(bi_fixture_t *f) { f->args.x.shape[1] = BI_HIDDEN / 2; }
static void x_ndim(bi_fixture_t *f) { f->args.x.ndim = 1; }
static void x_missing(bi_fixture_t *f) { f->args.x.data = NULL; }
static void scales_missing(bi_fixture_t *f) { f->args.x_scales = (epx_tensor_t)EPX_TENSOR_NONE; }
static void scales_cols(bi_fixture_t *f) { f->args.x_scales.shape[1] = 1; }
static void scales_rows(bi_fixture_t *f) { f->args.x_scales.shape[0] = BI_TOKENS - 1; }
static void scales_dtype(bi_fixture_t *f) { f->args.x_scales.dtype = EPX_DTYPE_BF16; }
static void scales_for_bf16(bi_fixture_t *f)
{
    f->args.x_scales = epx_tensor_2d(f->scales, EPX_DTYPE_FP32, BI_TOKENS, BI_HIDDEN / 128);
}
static void scales_column_overlap(bi_fixture_t *f)
{
    /* Column major, but columns closer than the column length: they would overlap. */
    f->args.x_scales.strides[0] = 1;
    f->args.x_scales.strides[1] = BI_TOKENS - 1;
}
static void idx_dtype(bi_fixture_t *f) { f->args.topk_idx.dtype = EPX_DTYPE_INT32; }
static void idx_cols(bi_fixture_t *f) { f->args.topk_idx.shape[1] = BI_TOPK + 1; }
static void idx_rows(bi_fixture_t *f) { f->args.topk_idx.shape[0] = BI_TOKENS - 1; }
static void idx_missing(bi_fixture_t *f) { f->args.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE; }
static void expert_too_big(bi_fixture_t *f) { bi_set_expert(f, 2, 1, f->c.num_experts); }
static void expert_negative(bi_fixture_t *f) { bi_set_expert(f, 1, 0, -2); }
static void weights_cols(bi_fixture_t *f) { f->args.topk_weights.shape[1] = BI_TOPK + 1; }
static void weights_dtype(bi_fixture_t *f) { f->args.topk_weights.dtype = EPX_DTYPE_BF16; }
static void bad_flags(bi_fixture_t *f) { f->args.flags = 0x80u; }
static void bad_alignment(bi_fixture_t *f) { f->args.expert_alignment = -4; }
static void outputs_too_small(bi_fixture_t *f) { attach_outputs(f, 1); }
static void outputs_not_worst_case(bi_fixture_t *f)
{
    /* Enough for what arrives, not for the worst case the flag promises. */
    attach_outputs(f, BI_TOKENS * bi_info.world_size);
    f->args.flags = EPX_DISPATCH_WORST_CASE;
}
static void output_missing(bi_fixture_t *f)
{
    attach_outputs(f, BI_MAX_TOKENS * bi_info.world_size);
    f->args.recv_topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
}
static void output_dtype(bi_fixture_t *f)
{
    attach_outputs(f, BI_MAX_TOKENS * bi_info.world_size);
    f->args.recv_x.dtype = EPX_DTYPE_FP8_E4M3;
}
static void output_without_recv_x(bi_fixture_t *f)
{
    attach_outputs(f, BI_MAX_TOKENS * bi_info.world_size);
    f->args.recv_x = (epx_tensor_t)EPX_TENSOR_NONE;
}
/* Route by the layout instead of topk_idx (counts and bits all zero: shapes matter here). */
static void by_layout(bi_fixture_t *f)
{
    int world = bi_info.world_size;
    f->outputs[0] = mr_mem_alloc((size_t)(BI_TOKENS * world), 0);
    f->outputs[1] = mr_mem_alloc((size_t)f->c.num_experts * 4, 0);
    f->args.topk_idx = (epx_tensor_t)EPX_TENSOR_NONE;
    f->args.topk_weights = (epx_tensor_t)EPX_TENSOR_NONE;
    f->args.is_token_in_rank = epx_tensor_2d(f->outputs[0], EPX_DTYPE_BOOL, BI_TOKENS, world);
    f->args.num_tokens_per_expert =
        epx_tensor_1d(f->outputs[1], EPX_DTYPE_INT32, f->c.num_experts);
}
static void layout_with_topk(bi_fixture_t *f)
{
    epx_tensor_t idx = f->args.topk_idx;
    by_layout(f);
    f->args.topk_idx = idx;
}
static void layout_with_weights(bi_fixture_t *f)
{
    epx_tensor_t weights = f->args.topk_weights;
    by_layout(f);
    f->args.topk_weights = weights;
}
static void layout_without_counts(bi_fixture_t *f)
{
    by_layout(f);
    f->args.num_tokens_per_expert = (epx_tensor_t)EPX_TENSOR_NONE;
}
static void layout_without_bits(bi_fixture_t *f)
{
    by_layout(f);
    f->args.is_token_in_rank = (epx_tensor_t)EPX_TENSOR_NONE;
}
static void layout_bits_dtype(bi_fixture_t *f)
{
    by_layout(f);
    f->args.is_token_in_rank.dtype = EPX_DTYPE_INT32;
}
static void layout_bits_rows(bi_fixture_t *f)
{
    by_layout(f);
    f->args.is_token_in_rank.shape[0] = BI_TOKENS - 1;
}
static void layout_bits_cols(bi_fixture_t *f)
{
    by_layout(f);
    f->args.is_token_in_rank.shape[1] = bi_info.world_size + 1;
}
static void layout_counts_len(bi_fixture_t *f)
{
    by_layout(f);
    f->args.num_tokens_per_expert.shape[0] = f->c.num_experts - 1;
}
static void layout_counts_dtype(bi_fixture_t *f)
{
    by_layout(f);
    f->args.num_tokens_per_expert.dtype = EPX_DTYPE_INT64;
}
static void layout_with_handle(bi_fixture_t *f)
{
    by_layout(f);
    f->args.handle = (epx_handle_t)f->outputs[0]; /* refused before it is looked at */
}
static void nothing(bi_fixture_t *f) { (void)f; }

/* How the call is broken besides the mutation. */
enum { CALL_PLAIN, CALL_NULL_BUFFER, CALL_NULL_ARGS, CALL_NULL_RESULT };

typedef struct {
    const char *what;
    epx_dtype_t dtype;
    int64_t tokens;
    int call;
    void (*mutate)(bi_fixture_t *f);
    epx_status_t want;
    const char *culprit;
} dispatch_case_t;

#define BF16 EPX_DTYPE_BF16
#define FP8 EPX_DTYPE_FP8_E4M3
#define INVALID EPX_ERR_INVALID_ARG
#define CAPACITY EPX_ERR_CAPACITY

static const dispatch_case_t dispatch_cases[] = {
    {"dispatch: NULL buffer", BF16, BI_TOKENS, CALL_NULL_BUFFER, nothing, INVALID, "buffer"},
    {"dispatch: NULL args", BF16, BI_TOKENS, CALL_NULL_ARGS, nothing, INVALID, "args"},
    {"dispatch: NULL result", BF16, BI_TOKENS, CALL_NULL_RESULT, nothing, INVALID, "result"},
    {"dispatch: args.size wrong", BF16, BI_TOKENS, CALL_PLAIN, args_size, INVALID, "size"},
    {"dispatch: result.size wrong", BF16, BI_TOKENS, CALL_PLAIN, result_size, INVALID, "size"},
    {"dispatch: x dtype fp32", BF16, BI_TOKENS, CALL_PLAIN, x_dtype_fp32, INVALID, "x"},
    {"dispatch: x dtype int64", BF16, BI_TOKENS, CALL_PLAIN, x_dtype_int64, INVALID, "x"},
    {"dispatch: x hidden != buffer hidden", BF16, BI_TOKENS, CALL_PLAIN, x_hidden, INVALID, "x"},
    {"dispatch: x 1-d", BF16, BI_TOKENS, CALL_PLAIN, x_ndim, INVALID, "x"},
    {"dispatch: x not given", BF16, BI_TOKENS, CALL_PLAIN, x_missing, INVALID, "x"},
    {"dispatch: fp8 x without x_scales", FP8, BI_TOKENS, CALL_PLAIN, scales_missing, INVALID,
     "x_scales"},
    {"dispatch: x_scales columns wrong", FP8, BI_TOKENS, CALL_PLAIN, scales_cols, INVALID,
     "x_scales"},
    {"dispatch: x_scales rows wrong", FP8, BI_TOKENS, CALL_PLAIN, scales_rows, INVALID,
     "x_scales"},
    {"dispatch: x_scales dtype bf16", FP8, BI_TOKENS, CALL_PLAIN, scales_dtype, INVALID,
     "x_scales"},
    {"dispatch: column-major x_scales overlapping", FP8, BI_TOKENS, CALL_PLAIN,
     scales_column_overlap, INVALID, "x_scales"},
    {"dispatch: x_scales with bf16 x", BF16, BI_TOKENS, CALL_PLAIN, scales_for_bf16, INVALID,
     "x_scales"},
    {"dispatch: topk_idx dtype int32", BF16, BI_TOKENS, CALL_PLAIN, idx_dtype, INVALID,
     "topk_idx"},
    {"dispatch: topk_idx columns != num_topk", BF16, BI_TOKENS, CALL_PLAIN, idx_cols, INVALID,
     "topk_idx"},
    {"dispatch: topk_idx rows != x rows", BF16, BI_TOKENS, CALL_PLAIN, idx_rows, INVALID,
     "topk_idx"},
    {"dispatch: topk_idx missing (fresh mode)", BF16, BI_TOKENS, CALL_PLAIN, idx_missing,
     INVALID, "topk_idx"},
    {"dispatch: expert id == num_experts", BF16, BI_TOKENS, CALL_PLAIN, expert_too_big,
     INVALID, "topk_idx"},
    {"dispatch: expert id -2", BF16, BI_TOKENS, CALL_PLAIN, expert_negative, INVALID,
     "topk_idx"},
    {"dispatch: topk_weights columns wrong", BF16, BI_TOKENS, CALL_PLAIN, weights_cols,
     INVALID, "topk_weights"},
    {"dispatch: topk_weights dtype bf16", BF16, BI_TOKENS, CALL_PLAIN, weights_dtype, INVALID,
     "topk_weights"},
    {"dispatch: unknown flag bits", BF16, BI_TOKENS, CALL_PLAIN, bad_flags, INVALID, "flags"},
    {"dispatch: expert_alignment negative", BF16, BI_TOKENS, CALL_PLAIN, bad_alignment,
     INVALID, "expert_alignment"},
    {"dispatch: more tokens than max_tokens", BF16, BI_MAX_TOKENS + 1, CALL_PLAIN, nothing,
     CAPACITY, "max_tokens_per_rank"},
    {"dispatch: caller recv_x too small", BF16, BI_TOKENS, CALL_PLAIN, outputs_too_small,
     CAPACITY, "recv_x"},
    {"dispatch: worst case, outputs too small", BF16, BI_TOKENS, CALL_PLAIN,
     outputs_not_worst_case, CAPACITY, "recv_x"},
    {"dispatch: recv_topk_idx missing", BF16, BI_TOKENS, CALL_PLAIN, output_missing, INVALID,
     "recv_topk_idx"},
    {"dispatch: recv_x dtype != x dtype", BF16, BI_TOKENS, CALL_PLAIN, output_dtype, INVALID,
     "recv_x"},
    {"dispatch: outputs without recv_x", BF16, BI_TOKENS, CALL_PLAIN, output_without_recv_x,
     INVALID, "recv_x"},
    {"dispatch: is_token_in_rank with topk_idx", BF16, BI_TOKENS, CALL_PLAIN, layout_with_topk,
     INVALID, "topk_idx"},
    {"dispatch: routed by layout with topk_weights", BF16, BI_TOKENS, CALL_PLAIN,
     layout_with_weights, INVALID, "topk_weights"},
    {"dispatch: is_token_in_rank without counts", BF16, BI_TOKENS, CALL_PLAIN,
     layout_without_counts, INVALID, "num_tokens_per_expert"},
    {"dispatch: num_tokens_per_expert without bits", BF16, BI_TOKENS, CALL_PLAIN,
     layout_without_bits, INVALID, "is_token_in_rank"},
    {"dispatch: is_token_in_rank dtype int32", BF16, BI_TOKENS, CALL_PLAIN, layout_bits_dtype,
     INVALID, "is_token_in_rank"},
    {"dispatch: is_token_in_rank rows != x rows", BF16, BI_TOKENS, CALL_PLAIN,
     layout_bits_rows, INVALID, "is_token_in_rank"},
    {"dispatch: is_token_in_rank columns != ranks", BF16, BI_TOKENS, CALL_PLAIN,
     layout_bits_cols, INVALID, "is_token_in_rank"},
    {"dispatch: num_tokens_per_expert length", BF16, BI_TOKENS, CALL_PLAIN, layout_counts_len,
     INVALID, "num_tokens_per_expert"},
    {"dispatch: num_tokens_per_expert dtype int64", BF16, BI_TOKENS, CALL_PLAIN,
     layout_counts_dtype, INVALID, "num_tokens_per_expert"},
    {"dispatch: is_token_in_rank with a handle", BF16, BI_TOKENS, CALL_PLAIN,
     layout_with_handle, INVALID, "handle"},
};

static void run_dispatch_case(const dispatch_case_t *dc)
{
    bi_fixture_t f;
    bi_setup(&f, dc->dtype, dc->tokens);
    dc->mutate(&f);
    epx_status_t got;
    switch (dc->call) {
    case CALL_NULL_BUFFER:
        got = epx_dispatch(NULL, &f.args, &f.result, NULL);
        break;
    case CALL_NULL_ARGS:
        got = epx_dispatch(f.buffer, NULL, &f.result, NULL);
        break;
    case CALL_NULL_RESULT:
        got = epx_dispatch(f.buffer, &f.args, NULL, NULL);
        break;
    default:
        got = epx_dispatch(f.buffer, &f.args, &f.result, NULL);
        break;
    }
    bi_expect(dc->what, got, dc->want, dc->culprit);
    /* Outputs are written only on success. */
    CHECK(f.result.handle == NULL);
    CHECK_EQ_INT(f.result.num_recv_tokens, 0);
    bi_teardown(&f);
}

/* After a rejected dispatch the buffer returns that first error, even for good input. */
static void run_poison_case(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    bi_set_expert(&f, 0, 0, 1000);
    bi_expect("dispatch: expert id 1000", epx_dispatch(f.buffer, &f.args, &f.result, NULL),
              EPX_ERR_INVALID_ARG, "topk_idx");
    bi_set_expert(&f, 0, 0, 0);
    bi_expect("dispatch: good input on a failed buffer",
              epx_dispatch(f.buffer, &f.args, &f.result, NULL), EPX_ERR_INVALID_ARG,
              "topk_idx");
    epx_status_t error = EPX_SUCCESS;
    char message[512];
    CHECK_OK(epx_get_async_error(f.buffer, &error, message, sizeof message));
    CHECK_STATUS(error, EPX_ERR_INVALID_ARG);
    CHECK(strstr(message, "topk_idx") != NULL);
    bi_teardown(&f);
}

/* Host memory is read by the entry point: a negative count is refused (host backend). */
static void run_negative_count_case(void)
{
    if (bi_info.backend != EPX_BACKEND_HOST)
        return;
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    by_layout(&f);
    ((int32_t *)f.outputs[1])[3] = -1;
    bi_expect("dispatch: num_tokens_per_expert[3] = -1",
              epx_dispatch(f.buffer, &f.args, &f.result, NULL), INVALID, "num_tokens_per_expert");
    bi_teardown(&f);
}

/* A bf16 dispatch produces no scales: recv_x_scales given with the other outputs. */
static void run_unwanted_output_case(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    int64_t rows = BI_MAX_TOKENS * bi_info.world_size;
    attach_outputs(&f, rows);
    f.args.recv_x_scales = epx_tensor_2d(f.outputs[1], EPX_DTYPE_FP32, rows, BI_HIDDEN / 128);
    bi_expect("dispatch: recv_x_scales given for bf16 x",
              epx_dispatch(f.buffer, &f.args, &f.result, NULL), INVALID, "recv_x_scales");
    CHECK_ERROR_MENTIONS("was given but this dispatch produces no");
    bi_teardown(&f);
}

/* fp8 x needs hidden % 128 == 0; a bf16 buffer of hidden 64 takes bf16 x only. */
static void run_fp8_narrow_hidden_case(void)
{
    const int64_t hidden = 64;
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = hidden;
    config.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size;
    config.num_topk = BI_TOPK;
    epx_buffer_t buffer = NULL;
    CHECK_OK(epx_buffer_create(bi_group, &config, &buffer));
    void *x = mr_mem_alloc((size_t)(BI_TOKENS * hidden), 0);
    void *idx = mr_mem_alloc((size_t)(BI_TOKENS * BI_TOPK) * 8, 0);
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_FP8_E4M3, BI_TOKENS, hidden);
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, BI_TOKENS, BI_TOPK);
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    bi_expect("dispatch: fp8 x on a buffer of hidden 64",
              epx_dispatch(buffer, &args, &result, NULL), INVALID, "hidden");
    CHECK_ERROR_MENTIONS("fp8 x needs hidden to be a multiple of 128");
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(x);
    mr_mem_free(idx);
}

/* Cached mode: x must have as many tokens as the handle routed. */
static void run_cached_rows_case(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    epx_handle_t handle = f.result.handle;
    epx_dispatch_args_t cached = EPX_DISPATCH_ARGS_INIT;
    cached.x = epx_tensor_2d(f.x, EPX_DTYPE_BF16, BI_TOKENS - 1, BI_HIDDEN);
    cached.handle = handle;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    bi_expect("cached dispatch: x rows != the handle's",
              epx_dispatch(f.buffer, &cached, &result, NULL), INVALID, "handle");
    CHECK_ERROR_MENTIONS("x has 3 tokens but the handle routed 4");
    CHECK(result.handle == NULL);
    CHECK_OK(epx_handle_destroy(handle));
    bi_teardown(&f);
}

/* The old args size (before the layout fields) is still accepted. */
static void run_old_size_case(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    f.args.size = offsetof(epx_dispatch_args_t, is_token_in_rank);
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    CHECK_OK(epx_handle_destroy(f.result.handle));
    bi_teardown(&f);
}

void bi_run_dispatch_cases(void)
{
    for (size_t i = 0; i < sizeof dispatch_cases / sizeof dispatch_cases[0]; i++)
        run_dispatch_case(&dispatch_cases[i]);
    run_poison_case();
    run_negative_count_case();
    run_old_size_case();
    run_unwanted_output_case();
    run_fp8_narrow_hidden_case();
    run_cached_rows_case();
    bi_expect("handle_get_rank_prefix_matrix: NULL handle",
              epx_handle_get_rank_prefix_matrix(NULL, &(epx_tensor_t)EPX_TENSOR_NONE), INVALID,
              "handle");

    /* The same arguments, unbroken, pass: the cases above failed for their one defect. */
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_FP8_E4M3, BI_MAX_TOKENS);
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    CHECK_EQ_INT(f.result.num_recv_tokens, BI_MAX_TOKENS); /* one rank: every token stays */
    CHECK_OK(epx_handle_destroy(f.result.handle));
    bi_teardown(&f);
}

/* ---------------------------------------------------------------- layout */

void bi_run_layout_cases(void)
{
    bi_fixture_t f;
    int world = bi_info.world_size;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    void *per_rank = mr_mem_alloc((size_t)world * 4, 0);
    void *per_expert = mr_mem_alloc((size_t)f.c.num_experts * 4, 0);
    void *in_rank = mr_mem_alloc((size_t)(BI_TOKENS * world), 0);
    epx_layout_args_t good = EPX_LAYOUT_ARGS_INIT, args;
    good.topk_idx = f.args.topk_idx;
    good.num_tokens_per_rank = epx_tensor_1d(per_rank, EPX_DTYPE_INT32, world);
    good.num_tokens_per_expert = epx_tensor_1d(per_expert, EPX_DTYPE_INT32, f.c.num_experts);
    good.is_token_in_rank = epx_tensor_2d(in_rank, EPX_DTYPE_BOOL, BI_TOKENS, world);

    bi_expect("layout: NULL buffer", epx_get_dispatch_layout(NULL, &good, NULL), INVALID,
              "buffer");
    bi_expect("layout: NULL args", epx_get_dispatch_layout(f.buffer, NULL, NULL), INVALID,
              "args");
    args = good;
    args.size = 1;
    bi_expect("layout: args.size wrong", epx_get_dispatch_layout(f.buffer, &args, NULL),
              INVALID, "size");
    args = good;
    args.topk_idx.dtype = EPX_DTYPE_INT32;
    bi_expect("layout: topk_idx dtype int32", epx_get_dispatch_layout(f.buffer, &args, NULL),
              INVALID, "topk_idx");
    args = good;
    args.num_tokens_per_rank.shape[0] = world + 1;
    bi_expect("layout: num_tokens_per_rank length", epx_get_dispatch_layout(f.buffer, &args, NULL),
              INVALID, "num_tokens_per_rank");
    args = good;
    args.num_tokens_per_expert.dtype = EPX_DTYPE_INT64;
    bi_expect("layout: num_tokens_per_expert dtype",
              epx_get_dispatch_layout(f.buffer, &args, NULL), INVALID, "num_tokens_per_expert");
    args = good;
    args.is_token_in_rank.shape[0] = BI_TOKENS + 1;
    bi_expect("layout: is_token_in_rank rows", epx_get_dispatch_layout(f.buffer, &args, NULL),
              INVALID, "is_token_in_rank");
    bi_set_expert(&f, 3, 1, f.c.num_experts + 5);
    if (mr_mem_is_device()) {
        /* On the GPU the layout kernel finds the id (topk_idx is device memory, read
         * without a host wait): the call returns, the failure is the buffer's async error
         * once the stream has run the kernel, and the next call reports it. The buffer
         * then fails like a dispatch given a bad id (include/epx.h). */
        CHECK_OK(epx_get_dispatch_layout(f.buffer, &good, NULL));
        bi_expect_async(f.buffer, "layout: expert id out of range (async)",
                        "get_dispatch_layout: topk_idx[3][1]");
        bi_expect("layout: expert id out of range (the next call)",
                  epx_get_dispatch_layout(f.buffer, &good, NULL), INVALID, "topk_idx");
        bi_teardown(&f);
        bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
        good.topk_idx = f.args.topk_idx;
    } else {
        bi_expect("layout: expert id out of range",
                  epx_get_dispatch_layout(f.buffer, &good, NULL), INVALID, "topk_idx");
        /* Layout is local: a rejected layout does not poison the buffer. */
        bi_set_expert(&f, 3, 1, 0);
    }
    CHECK_OK(epx_get_dispatch_layout(f.buffer, &good, NULL));
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    CHECK_OK(epx_handle_destroy(f.result.handle));

    mr_mem_free(per_rank);
    mr_mem_free(per_expert);
    mr_mem_free(in_rank);
    bi_teardown(&f);
}
