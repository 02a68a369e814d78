/*
 * Argument checks of the entry points (see validate.h).
 */
#include <stddef.h>
#include <string.h>

#include "core/objects.h"
#include "validate.h"

/* Largest hidden size accepted; keeps row byte counts far from overflow. */
#define EPX_MAX_HIDDEN (1 << 20)

static int is_token_dtype(epx_dtype_t dtype)
{
    return dtype == EPX_DTYPE_BF16 || dtype == EPX_DTYPE_FP8_E4M3;
}

epx_status_t epx__validate_buffer_config(epx_group_t group, const epx_buffer_config_t *config)
{
    if (group == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer: group is NULL");
    if (config == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer: config is NULL");
    /* Configs from before max_low_latency_tokens, low_latency_dtype and auto_register
     * were appended are still accepted; the fields they lack read as 0. */
    if (config->size != sizeof(epx_buffer_config_t) &&
        config->size != offsetof(epx_buffer_config_t, auto_register) &&
        config->size != offsetof(epx_buffer_config_t, low_latency_dtype) &&
        config->size != offsetof(epx_buffer_config_t, max_low_latency_tokens))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.size is %zu, expected %zu (initialise with "
                         "EPX_BUFFER_CONFIG_INIT)",
                         config->size, sizeof(epx_buffer_config_t));
    if (config->max_tokens_per_rank < 1 || config->max_tokens_per_rank > (1 << 24))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.max_tokens_per_rank is %lld, expected 1..16777216",
                         (long long)config->max_tokens_per_rank);
    if (config->hidden < 1 || config->hidden > EPX_MAX_HIDDEN)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer: config.hidden is %lld, expected 1..%d",
                         (long long)config->hidden, EPX_MAX_HIDDEN);
    if (config->hidden % 8 != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.hidden is %lld, expected a multiple of 8 (rows move "
                         "as 16-byte vectors)",
                         (long long)config->hidden);
    if (!is_token_dtype(config->dispatch_dtype))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.dispatch_dtype is %s, expected bf16 or fp8_e4m3",
                         epx_dtype_name(config->dispatch_dtype));
    if (config->dispatch_dtype == EPX_DTYPE_FP8_E4M3 && config->hidden % EPX__FP8_BLOCK != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.hidden is %lld, fp8 dispatch needs a multiple of 128 "
                         "(one scale per 128 channels)",
                         (long long)config->hidden);
    if (config->num_experts < 1 || config->num_experts % group->world_size != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.num_experts is %d, expected a positive multiple of "
                         "the world size %d",
                         config->num_experts, group->world_size);
    if (config->num_topk < 1 || config->num_topk > config->num_experts)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer: config.num_topk is %d, expected 1..%d",
                         config->num_topk, config->num_experts);
    if (config->num_sms < 0 || config->num_sms > 1024)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "buffer: config.num_sms is %d, expected 0..1024",
                         config->num_sms);
    if (config->size > offsetof(epx_buffer_config_t, max_low_latency_tokens) &&
        (config->max_low_latency_tokens < 0 || config->max_low_latency_tokens > 65536))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.max_low_latency_tokens is %lld, expected 0 (off)..65536",
                         (long long)config->max_low_latency_tokens);
    if (config->size == sizeof(epx_buffer_config_t) &&
        (config->auto_register < -1 || config->auto_register > 1))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.auto_register is %d, expected -1 (copy x in), 0 "
                         "(EPX_AUTO_REGISTER) or 1 (map x's allocation)",
                         config->auto_register);
    if (config->size > offsetof(epx_buffer_config_t, low_latency_dtype) &&
        config->low_latency_dtype != EPX_DTYPE_INVALID &&
        !is_token_dtype(config->low_latency_dtype))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.low_latency_dtype is %s (%d), expected bf16 (or 0) or "
                         "fp8_e4m3",
                         epx_dtype_name(config->low_latency_dtype),
                         (int)config->low_latency_dtype);
    if (config->size > offsetof(epx_buffer_config_t, low_latency_dtype) &&
        config->low_latency_dtype == EPX_DTYPE_FP8_E4M3 && config->hidden % EPX__FP8_BLOCK != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "buffer: config.low_latency_dtype is fp8_e4m3 but config.hidden is "
                         "%lld; fp8 dispatch needs a multiple of 128 (one scale per 128 "
                         "channels)",
                         (long long)config->hidden);
    return EPX_SUCCESS;
}

void epx__buffer_config_read(const epx_buffer_config_t *config, epx_buffer_config_t *full)
{
    memset(full, 0, sizeof(*full));
    memcpy(full, config, config->size < sizeof(*full) ? config->size : sizeof(*full));
    full->size = sizeof(*full);
    /* Backends see BF16 or FP8_E4M3 only: 0 (and a config without the field) means BF16. */
    if (full->low_latency_dtype == EPX_DTYPE_INVALID)
        full->low_latency_dtype = EPX_DTYPE_BF16;
    /* Backends see 1 or -1: 0 (and a config without the field) means EPX_AUTO_REGISTER. */
    if (full->auto_register == 0)
        full->auto_register = epx__param_int(EPX_PARAM_AUTO_REGISTER) ? 1 : -1;
}

epx_status_t epx__validate_topk_values(const char *op, const epx_tensor_t *topk_idx,
                                       int num_experts)
{
    int64_t rows = topk_idx->shape[0], cols = topk_idx->shape[1];
    int64_t stride = epx__tensor_row_stride(topk_idx);
    const int64_t *idx = topk_idx->data;
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t j = 0; j < cols; j++) {
            int64_t e = idx[t * stride + j];
            if (e < -1 || e >= num_experts)
                return EPX_ERROR(EPX_ERR_INVALID_ARG,
                                 "%s: topk_idx[%lld][%lld] is %lld, expected -1 (none) or an "
                                 "expert id in 0..%d",
                                 op, (long long)t, (long long)j, (long long)e, num_experts - 1);
        }
    }
    return EPX_SUCCESS;
}

epx_status_t epx__validate_layout(epx_buffer_t buffer, const epx_layout_args_t *args)
{
    const char *op = "get_dispatch_layout";
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: args is NULL", op);
    if (args->size != sizeof(epx_layout_args_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: args.size is %zu, expected %zu (use EPX_LAYOUT_ARGS_INIT)", op,
                         args->size, sizeof(epx_layout_args_t));
    const epx_buffer_config_t *config = &buffer->config;
    int world = buffer->group->world_size;
    EPX_CHECK(epx__check_tensor(op, "topk_idx", &args->topk_idx, EPX_DTYPE_INT64, 2, -1,
                                config->num_topk));
    int64_t tokens = args->topk_idx.shape[0];
    EPX_CHECK(epx__check_tensor(op, "num_tokens_per_rank", &args->num_tokens_per_rank,
                                EPX_DTYPE_INT32, 1, world, -1));
    EPX_CHECK(epx__check_tensor(op, "num_tokens_per_expert", &args->num_tokens_per_expert,
                                EPX_DTYPE_INT32, 1, config->num_experts, -1));
    if (epx__tensor_given(&args->is_token_in_rank))
        EPX_CHECK(epx__check_tensor(op, "is_token_in_rank", &args->is_token_in_rank,
                                    EPX_DTYPE_BOOL, 2, tokens, world));
    return EPX_SUCCESS;
}

/* Optional dispatch output: given iff `wanted`, with the row count checked against need. */
static epx_status_t check_dispatch_output(const char *name, const epx_tensor_t *tensor,
                                          int wanted, epx_dtype_t dtype, int64_t cols,
                                          int64_t min_rows)
{
    const char *op = "dispatch";
    int given = epx__tensor_given(tensor);
    if (!wanted) {
        if (given)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: %s was given but this dispatch produces no %s (see epx.h)",
                             op, name, name);
        return EPX_SUCCESS;
    }
    if (!given)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: recv_x was given, so %s must be given too (outputs are either "
                         "all caller-owned or all buffer views)",
                         op, name);
    EPX_CHECK(epx__check_tensor(op, name, tensor, dtype, 2, -1, cols));
    if (tensor->shape[0] < min_rows)
        return EPX_ERROR(EPX_ERR_CAPACITY,
                         "%s: %s has %lld rows; worst-case mode needs max_tokens_per_rank * "
                         "world_size = %lld",
                         op, name, (long long)tensor->shape[0], (long long)min_rows);
    return EPX_SUCCESS;
}

/*
 * x_scales may be row major or column major ([tokens, S] with strides [1, >= tokens], as
 * DeepEP's callers pass x_scales.T.contiguous().T). A column-major one is checked as its
 * transpose, which is row major, once its shape is known to be right.
 */
static epx_status_t check_scales(const char *op, const epx_tensor_t *scales, int64_t rows,
                                 int64_t cols)
{
    if (epx__tensor_given(scales) && scales->ndim == 2 && scales->shape[0] == rows &&
        scales->shape[1] == cols && scales->strides[0] == 1 && scales->strides[1] > 1) {
        epx_tensor_t transposed = *scales;
        transposed.shape[0] = cols;
        transposed.shape[1] = rows;
        transposed.strides[0] = scales->strides[1];
        transposed.strides[1] = 1;
        return epx__check_tensor(op, "x_scales", &transposed, EPX_DTYPE_FP32, 2, cols, rows);
    }
    return epx__check_tensor(op, "x_scales", scales, EPX_DTYPE_FP32, 2, rows, cols);
}

epx_status_t epx__validate_dispatch(epx_buffer_t buffer, const epx_dispatch_args_t *args,
                                    const epx_dispatch_result_t *result)
{
    const char *op = "dispatch";
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: args is NULL", op);
    if (args->size != sizeof(epx_dispatch_args_t) &&
        args->size != offsetof(epx_dispatch_args_t, is_token_in_rank))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: args.size is %zu, expected %zu (use EPX_DISPATCH_ARGS_INIT)", op,
                         args->size, sizeof(epx_dispatch_args_t));
    if (result == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: result is NULL", op);
    if (result->size != sizeof(epx_dispatch_result_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: result.size is %zu, expected %zu (use EPX_DISPATCH_RESULT_INIT)",
                         op, result->size, sizeof(epx_dispatch_result_t));
    if ((args->flags & ~EPX_DISPATCH_WORST_CASE) != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: flags 0x%x has unknown bits", op,
                         args->flags);
    if (args->expert_alignment < 0 || args->expert_alignment > (1 << 20))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: expert_alignment is %d, expected 0..%d", op,
                         args->expert_alignment, 1 << 20);

    const epx_buffer_config_t *config = &buffer->config;
    int world = buffer->group->world_size;
    EPX_CHECK(epx__check_tensor(op, "x", &args->x, EPX_DTYPE_INVALID, 2, -1, config->hidden));
    epx_dtype_t dtype = args->x.dtype;
    if (!is_token_dtype(dtype))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: x has dtype %s, expected bf16 or fp8_e4m3",
                         op, epx_dtype_name(dtype));
    int64_t tokens = args->x.shape[0];
    if (tokens > config->max_tokens_per_rank)
        return EPX_ERROR(EPX_ERR_CAPACITY,
                         "%s: x has %lld tokens, more than the buffer's max_tokens_per_rank %lld",
                         op, (long long)tokens, (long long)config->max_tokens_per_rank);
    int fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    if (fp8) {
        if (config->hidden % EPX__FP8_BLOCK != 0)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: fp8 x needs hidden to be a multiple of 128, the buffer has %lld",
                             op, (long long)config->hidden);
        EPX_CHECK(check_scales(op, &args->x_scales, tokens, config->hidden / EPX__FP8_BLOCK));
    } else if (epx__tensor_given(&args->x_scales)) {
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: x_scales given but x is bf16", op);
    }

    int has_idx = 0, has_weights = 0;
    int by_layout = epx__tensor_given(&args->is_token_in_rank) ||
                    epx__tensor_given(&args->num_tokens_per_expert);
    if (by_layout && (args->handle != NULL || epx__tensor_given(&args->topk_idx)))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: is_token_in_rank and num_tokens_per_expert route a fresh dispatch "
                         "without topk_idx; they cannot be given with %s",
                         op, args->handle != NULL ? "a handle (cached mode)" : "topk_idx");
    if (by_layout) {
        EPX_CHECK(epx__check_tensor(op, "is_token_in_rank", &args->is_token_in_rank,
                                    EPX_DTYPE_BOOL, 2, tokens, world));
        EPX_CHECK(epx__check_tensor(op, "num_tokens_per_expert", &args->num_tokens_per_expert,
                                    EPX_DTYPE_INT32, 1, config->num_experts, -1));
        if (epx__tensor_given(&args->topk_weights))
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: topk_weights needs topk_idx (a dispatch routed by "
                             "is_token_in_rank has no top-k outputs)",
                             op);
    } else if (args->handle != NULL) {
        EPX_CHECK(epx__object_check(EPX__OBJECT_HANDLE, args->handle, op, "handle"));
        if (args->handle->buffer != buffer || args->handle->buffer_serial != buffer->serial)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: handle was made by another buffer", op);
        if (args->handle->num_tokens != tokens)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: cached mode: x has %lld tokens but the handle routed %lld",
                             op, (long long)tokens, (long long)args->handle->num_tokens);
        if (epx__tensor_given(&args->topk_idx) || epx__tensor_given(&args->topk_weights))
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: cached mode (handle given) takes no topk_idx or topk_weights; "
                             "the routing comes from the handle",
                             op);
    } else {
        if (!epx__tensor_given(&args->topk_idx))
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: topk_idx is required in fresh mode (or is_token_in_rank and "
                             "num_tokens_per_expert to route by the layout, or a handle for "
                             "cached mode)",
                             op);
        EPX_CHECK(epx__check_tensor(op, "topk_idx", &args->topk_idx, EPX_DTYPE_INT64, 2, tokens,
                                    config->num_topk));
        has_idx = 1;
        if (epx__tensor_given(&args->topk_weights)) {
            EPX_CHECK(epx__check_tensor(op, "topk_weights", &args->topk_weights,
                                        EPX_DTYPE_FP32, 2, tokens, config->num_topk));
            has_weights = 1;
        }
    }

    int64_t worst = config->max_tokens_per_rank * world;
    int64_t min_rows = (args->flags & EPX_DISPATCH_WORST_CASE) ? worst : 0;
    if (epx__tensor_given(&args->recv_x)) {
        EPX_CHECK(check_dispatch_output("recv_x", &args->recv_x, 1, dtype, config->hidden,
                                        min_rows));
        EPX_CHECK(check_dispatch_output("recv_x_scales", &args->recv_x_scales, fp8,
                                        EPX_DTYPE_FP32, config->hidden / EPX__FP8_BLOCK, min_rows));
        EPX_CHECK(check_dispatch_output("recv_topk_idx", &args->recv_topk_idx, has_idx,
                                        EPX_DTYPE_INT64, config->num_topk, min_rows));
        EPX_CHECK(check_dispatch_output("recv_topk_weights", &args->recv_topk_weights,
                                        has_weights, EPX_DTYPE_FP32, config->num_topk, min_rows));
    } else if (epx__tensor_given(&args->recv_x_scales) ||
               epx__tensor_given(&args->recv_topk_idx) ||
               epx__tensor_given(&args->recv_topk_weights)) {
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: recv_x is not given, so no other output may be (outputs are "
                         "either all caller-owned or all buffer views)",
                         op);
    }
    return EPX_SUCCESS;
}

epx_status_t epx__validate_layout_counts(const char *op, const epx_tensor_t *counts)
{
    const int32_t *value = counts->data;
    for (int64_t e = 0; e < counts->shape[0]; e++)
        if (value[e] < 0)
            return EPX_ERROR(EPX_ERR_INVALID_ARG,
                             "%s: num_tokens_per_expert[%lld] is %d, expected a count >= 0", op,
                             (long long)e, value[e]);
    return EPX_SUCCESS;
}

void epx__dispatch_args_read(const epx_dispatch_args_t *args, epx_dispatch_args_t *full)
{
    memset(full, 0, sizeof(*full));
    memcpy(full, args, args->size < sizeof(*full) ? args->size : sizeof(*full));
    full->size = sizeof(*full);
}

epx_status_t epx__validate_combine(epx_buffer_t buffer, const epx_combine_args_t *args)
{
    const char *op = "combine";
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: args is NULL", op);
    if (args->size != sizeof(epx_combine_args_t) &&
        args->size != offsetof(epx_combine_args_t, bias) &&
        args->size != offsetof(epx_combine_args_t, order_topk_idx))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: args.size is %zu, expected %zu (use EPX_COMBINE_ARGS_INIT)", op,
                         args->size, sizeof(epx_combine_args_t));
    const struct epx_handle *handle = args->handle;
    if (handle == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: handle is required (from dispatch)", op);
    EPX_CHECK(epx__object_check(EPX__OBJECT_HANDLE, handle, op, "handle"));
    if (handle->buffer != buffer || handle->buffer_serial != buffer->serial)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: handle was made by another buffer", op);
    const epx_buffer_config_t *config = &buffer->config;
    /* A worst-case-mode handle of a GPU backend may not know its row count on the host. */
    int64_t recv = handle->num_recv_tokens >= 0 ? handle->num_recv_tokens : -1;
    EPX_CHECK(epx__check_tensor(op, "x", &args->x, EPX_DTYPE_BF16, 2, recv, config->hidden));
    EPX_CHECK(epx__check_tensor(op, "out_x", &args->out_x, EPX_DTYPE_BF16, 2, handle->num_tokens,
                                config->hidden));
    if (epx__tensor_given(&args->topk_weights)) {
        EPX_CHECK(epx__check_tensor(op, "topk_weights", &args->topk_weights, EPX_DTYPE_FP32, 2,
                                    args->x.shape[0], config->num_topk));
        EPX_CHECK(epx__check_tensor(op, "out_topk_weights", &args->out_topk_weights,
                                    EPX_DTYPE_FP32, 2, handle->num_tokens, config->num_topk));
    } else if (epx__tensor_given(&args->out_topk_weights)) {
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: out_topk_weights given without topk_weights to combine", op);
    }
    static const char *const bias_names[2] = {"bias[0]", "bias[1]"};
    for (int j = 0; j < 2; j++) {
        if (!epx__tensor_given(&args->bias[j]))
            continue;
        EPX_CHECK(epx__check_tensor(op, bias_names[j], &args->bias[j], EPX_DTYPE_BF16, 2,
                                    handle->num_tokens, config->hidden));
    }
    if (epx__tensor_given(&args->order_topk_idx))
        EPX_CHECK(epx__check_tensor(op, "order_topk_idx", &args->order_topk_idx,
                                    EPX_DTYPE_INT64, 2, handle->num_tokens, config->num_topk));
    return EPX_SUCCESS;
}

void epx__combine_args_read(const epx_combine_args_t *args, epx_combine_args_t *full)
{
    memset(full, 0, sizeof(*full));
    memcpy(full, args, args->size < sizeof(*full) ? args->size : sizeof(*full));
    full->size = sizeof(*full);
}
