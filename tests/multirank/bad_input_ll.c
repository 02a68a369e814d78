/*
 * Rejected inputs of the low-latency entry points (one rank). Each is refused before
 * anything is sent, so unlike normal mode the buffer stays usable: the last case runs
 * a valid step on the same buffer.
 */
#include <stdlib.h>
#include <string.h>

#include "bad_input.h"
#include "test_util.h"

#define LL_HIDDEN 256
#define LL_TOKENS 4

static epx_buffer_t ll_buffer(int64_t hidden, int64_t max_ll)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = hidden;
    config.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size;
    config.num_topk = BI_TOPK;
    config.max_low_latency_tokens = max_ll;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(bi_group, &config, &buffer));
    return buffer;
}

static uint16_t x_data[BI_MAX_TOKENS * 2 * 512];
static int64_t idx_data[BI_MAX_TOKENS * 2 * BI_TOPK];
static float weight_data[BI_MAX_TOKENS * 2 * BI_TOPK];
static uint16_t out_data[BI_MAX_TOKENS * 2 * 512];

static epx_ll_dispatch_args_t ll_args(int64_t hidden, int64_t tokens)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    for (int64_t i = 0; i < tokens * BI_TOPK; i++)
        idx_data[i] = i % BI_EXPERTS_PER_RANK;
    args.x = epx_tensor_2d(x_data, EPX_DTYPE_BF16, tokens, hidden);
    args.topk_idx = epx_tensor_2d(idx_data, EPX_DTYPE_INT64, tokens, BI_TOPK);
    return args;
}

static epx_ll_combine_args_t ll_combine_args(epx_ll_handle_t handle, epx_tensor_t x)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = x;
    args.topk_idx = epx_tensor_2d(idx_data, EPX_DTYPE_INT64, LL_TOKENS, BI_TOPK);
    args.topk_weights = epx_tensor_2d(weight_data, EPX_DTYPE_FP32, LL_TOKENS, BI_TOPK);
    args.out = epx_tensor_2d(out_data, EPX_DTYPE_BF16, LL_TOKENS, LL_HIDDEN);
    return args;
}

void bi_run_ll_cases(void)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = LL_HIDDEN;
    config.num_experts = BI_EXPERTS_PER_RANK;
    config.num_topk = BI_TOPK;
    config.max_low_latency_tokens = -1;
    epx_buffer_t none;
    bi_expect("ll: negative max_low_latency_tokens", epx_buffer_create(bi_group, &config, &none),
              EPX_ERR_INVALID_ARG, "max_low_latency_tokens");

    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    epx_ll_dispatch_args_t args;
    epx_buffer_t off = ll_buffer(LL_HIDDEN, 0);
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    bi_expect("ll: dispatch on a buffer without it", epx_ll_dispatch(off, &args, &result, NULL),
              EPX_ERR_INVALID_STATE, "max_low_latency_tokens");
    CHECK_OK(epx_buffer_destroy(off));

    epx_buffer_t buffer = ll_buffer(LL_HIDDEN, BI_MAX_TOKENS);
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.size = 8;
    bi_expect("ll: dispatch args.size", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "size");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.x.dtype = EPX_DTYPE_FP32;
    bi_expect("ll: x not bf16", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "x");
    args = ll_args(LL_HIDDEN, BI_MAX_TOKENS + 1);
    bi_expect("ll: more tokens than max_low_latency_tokens",
              epx_ll_dispatch(buffer, &args, &result, NULL), EPX_ERR_CAPACITY, "x");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.topk_idx.shape[1] = BI_TOPK + 1;
    bi_expect("ll: topk_idx width", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "topk_idx");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    idx_data[3] = BI_EXPERTS_PER_RANK * bi_info.world_size;
    bi_expect("ll: expert id out of range", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "topk_idx");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.use_fp8 = 1;
    args.use_ue8m0 = 1;
    bi_expect("ll: ue8m0 without round_scale", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "round_scale");
    args.round_scale = 1;
    bi_expect("ll: ue8m0 with hidden 256", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "use_ue8m0");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.round_scale = 1;
    bi_expect("ll: round_scale without fp8", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "use_fp8");
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    args.flags = 0x80;
    bi_expect("ll: unknown flags", epx_ll_dispatch(buffer, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "flags");

    epx_buffer_t narrow = ll_buffer(64, BI_MAX_TOKENS);
    args = ll_args(64, LL_TOKENS);
    args.use_fp8 = 1;
    bi_expect("ll: fp8 with hidden 64", epx_ll_dispatch(narrow, &args, &result, NULL),
              EPX_ERR_INVALID_ARG, "use_fp8");
    CHECK_OK(epx_buffer_destroy(narrow));

    /* A valid step, then bad combines on it. */
    args = ll_args(LL_HIDDEN, LL_TOKENS);
    CHECK_OK(epx_ll_dispatch(buffer, &args, &result, NULL));
    epx_tensor_t x;
    CHECK_OK(epx_ll_get_combine_buffer(buffer, result.handle, &x));
    epx_ll_combine_args_t back = ll_combine_args(result.handle, x);
    back.x.shape[1] -= 1;
    bi_expect("ll: combine x shape", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "x");
    back = ll_combine_args(result.handle, x);
    back.out = epx_tensor_2d(out_data, EPX_DTYPE_BF16, LL_TOKENS + 1, LL_HIDDEN);
    bi_expect("ll: combine out rows", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "out");
    back = ll_combine_args(result.handle, x);
    back.topk_weights.dtype = EPX_DTYPE_BF16;
    bi_expect("ll: combine topk_weights dtype", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "topk_weights");
    back = ll_combine_args(result.handle, x);
    back.handle.internal[0] ^= 1;
    bi_expect("ll: combine handle of another buffer", epx_ll_combine(buffer, &back, NULL, NULL),
              EPX_ERR_INVALID_ARG, "handle");
    bi_expect("ll: mask an out-of-range rank", epx_ll_mask_rank(buffer, bi_info.world_size),
              EPX_ERR_INVALID_ARG, "rank");
    bi_expect("ll: mask itself", epx_ll_mask_rank(buffer, bi_info.rank), EPX_ERR_INVALID_ARG,
              "rank");
    int32_t mask[1];
    if (bi_info.world_size > 1)
        bi_expect("ll: get_masked count", epx_ll_get_masked(buffer, mask, 1), EPX_ERR_INVALID_ARG,
                  "count");

    /* None of that had an effect: the step still combines. */
    memset(x.data, 0, (size_t)(x.shape[0] * x.shape[1] * x.shape[2]) * 2);
    back = ll_combine_args(result.handle, x);
    CHECK_OK(epx_ll_combine(buffer, &back, NULL, NULL));
    CHECK_OK(epx_buffer_destroy(buffer));
}
