/*
 * Argument checks of the low-latency entry points (see validate.h). Shapes follow
 * include/epx.h: M = max_low_latency_tokens, R = world size, L = local experts.
 */

#include "validate.h"

/* A contiguous 3-d tensor of the given dtype and shape (strides all 0 or row major). */
static epx_status_t epx__check_tensor_3d(const char *op, const char *name,
                                         const epx_tensor_t *tensor, epx_dtype_t dtype,
                                         int64_t dim0, int64_t dim1, int64_t dim2)
{
    if (!epx__tensor_given(tensor))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s is required", op, name);
    if (tensor->dtype != dtype)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s has dtype %s, expected %s", op, name,
                         epx_dtype_name(tensor->dtype), epx_dtype_name(dtype));
    if (tensor->ndim != 3 || tensor->shape[0] != dim0 || tensor->shape[1] != dim1 ||
        tensor->shape[2] != dim2)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %s has %d dims [%lld, %lld, %lld], expected [%lld, %lld, %lld] "
                         "(local experts, max_low_latency_tokens * world size, hidden)",
                         op, name, tensor->ndim, (long long)tensor->shape[0],
                         (long long)tensor->shape[1], (long long)tensor->shape[2],
                         (long long)dim0, (long long)dim1, (long long)dim2);
    int zero = tensor->strides[0] == 0 && tensor->strides[1] == 0 && tensor->strides[2] == 0;
    int dense = tensor->strides[2] == 1 && tensor->strides[1] == dim2 &&
                tensor->strides[0] == dim1 * dim2;
    if (!zero && !dense)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s must be contiguous (row major)", op, name);
    return EPX_SUCCESS;
}

static epx_status_t epx__check_ll_enabled(epx_buffer_t buffer, const char *op)
{
    if (buffer->config.max_low_latency_tokens <= 0)
        return EPX_ERROR(EPX_ERR_INVALID_STATE,
                         "%s: the buffer was created with max_low_latency_tokens = 0 "
                         "(low-latency mode off); set it in epx_buffer_config_t",
                         op);
    return EPX_SUCCESS;
}

/* The backend's alignment of rows (16-byte vectors on the GPU), for tensor `name`. */
static epx_status_t check_row_align(epx_buffer_t buffer, const char *op, const char *name,
                                    const epx_tensor_t *t)
{
    int align = buffer->ops->ll_row_align;
    if (align <= 1)
        return EPX_SUCCESS;
    int64_t pitch = epx__tensor_row_stride(t) * (int64_t)epx_dtype_size(t->dtype);
    if (((uintptr_t)t->data | (uintptr_t)pitch) % (uintptr_t)align != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %s rows must start on %d-byte boundaries on the %s backend (data "
                         "%p, row pitch %lld bytes)",
                         op, name, align, buffer->ops->name, t->data, (long long)pitch);
    return EPX_SUCCESS;
}

/*
 * The optional wait_recv_cost_stats: [R] int64, contiguous (one entry per peer rank), on a
 * buffer whose backend fills it. Refused before anything is sent, as every rank refuses
 * alike (the ranks of a buffer share its backend and kernels).
 */
static epx_status_t check_wait_stats(epx_buffer_t buffer, const char *op, const epx_tensor_t *t)
{
    if (!epx__tensor_given(t))
        return EPX_SUCCESS;
    EPX_CHECK(epx__check_tensor(op, "wait_recv_cost_stats", t, EPX_DTYPE_INT64, 1,
                                buffer->group->world_size, -1));
    if (buffer->ops->ll_check_wait_stats != NULL)
        EPX_CHECK(buffer->ops->ll_check_wait_stats(buffer, op));
    return EPX_SUCCESS;
}

epx_status_t epx__validate_ll_dispatch(epx_buffer_t buffer, const epx_ll_dispatch_args_t *args,
                                       const epx_ll_dispatch_result_t *result)
{
    const char *op = "ll_dispatch";
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: args is NULL", op);
    /* epx_ll_dispatch reads args of the older sizes as the full struct first. */
    if (args->size != sizeof(epx_ll_dispatch_args_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: args.size is %zu, expected %zu (use EPX_LL_DISPATCH_ARGS_INIT)", op,
                         args->size, sizeof(epx_ll_dispatch_args_t));
    if (result == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: result is NULL", op);
    if (result->size != sizeof(epx_ll_dispatch_result_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: result.size is %zu, expected %zu (use EPX_LL_DISPATCH_RESULT_INIT)",
                         op, result->size, sizeof(epx_ll_dispatch_result_t));
    EPX_CHECK(epx__check_ll_enabled(buffer, op));
    if ((args->flags & ~EPX_LL_SEND_ONLY) != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: flags 0x%x has unknown bits", op, args->flags);
    const epx_buffer_config_t *config = &buffer->config;
    EPX_CHECK(epx__check_tensor(op, "x", &args->x, EPX_DTYPE_BF16, 2, -1, config->hidden));
    EPX_CHECK(check_row_align(buffer, op, "x", &args->x));
    int64_t tokens = args->x.shape[0];
    if (tokens > config->max_low_latency_tokens)
        return EPX_ERROR(EPX_ERR_CAPACITY,
                         "%s: x has %lld tokens, more than the buffer's max_low_latency_tokens "
                         "%lld",
                         op, (long long)tokens, (long long)config->max_low_latency_tokens);
    EPX_CHECK(epx__check_tensor(op, "topk_idx", &args->topk_idx, EPX_DTYPE_INT64, 2, tokens,
                                config->num_topk));
    if (epx__tensor_given(&args->cumulative_local_expert_recv_stats))
        EPX_CHECK(epx__check_tensor(op, "cumulative_local_expert_recv_stats",
                                    &args->cumulative_local_expert_recv_stats, EPX_DTYPE_INT32, 1,
                                    buffer->num_local_experts, -1));
    EPX_CHECK(check_wait_stats(buffer, op, &args->wait_recv_cost_stats));
    if (!args->use_fp8 && config->low_latency_dtype == EPX_DTYPE_FP8_E4M3)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: the buffer was created with config.low_latency_dtype = fp8_e4m3 "
                         "(rows sized for fp8); pass use_fp8 = 1 or create it with bf16",
                         op);
    if (!args->use_fp8 && (args->round_scale || args->use_ue8m0))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: round_scale and use_ue8m0 apply to fp8 only; use_fp8 is 0", op);
    if (args->use_fp8 && config->hidden % EPX__FP8_BLOCK != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: use_fp8 needs hidden to be a multiple of 128 (one scale per 128 "
                         "channels); the buffer has hidden %lld",
                         op, (long long)config->hidden);
    if (args->use_ue8m0 && !args->round_scale)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: use_ue8m0 needs round_scale (ue8m0 holds powers of two only)", op);
    if (args->use_ue8m0 && config->hidden % EPX__UE8M0_GROUP != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: use_ue8m0 needs hidden to be a multiple of 512 (four scales per "
                         "int32); the buffer has hidden %lld",
                         op, (long long)config->hidden);
    return EPX_SUCCESS;
}

epx_status_t epx__validate_ll_combine(epx_buffer_t buffer, const epx_ll_combine_args_t *args,
                                      int64_t num_tokens)
{
    const char *op = "ll_combine";
    const epx_buffer_config_t *config = &buffer->config;
    if ((args->flags & ~EPX_LL_SEND_ONLY) != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: flags 0x%x has unknown bits", op, args->flags);
    int64_t rows = config->max_low_latency_tokens * buffer->group->world_size;
    EPX_CHECK(epx__check_tensor_3d(op, "x", &args->x, EPX_DTYPE_BF16, buffer->num_local_experts,
                                   rows, config->hidden));
    EPX_CHECK(epx__check_tensor(op, "topk_idx", &args->topk_idx, EPX_DTYPE_INT64, 2, num_tokens,
                                config->num_topk));
    EPX_CHECK(epx__check_tensor(op, "topk_weights", &args->topk_weights, EPX_DTYPE_FP32, 2,
                                num_tokens, config->num_topk));
    EPX_CHECK(epx__check_tensor(op, "out", &args->out, EPX_DTYPE_BF16, 2, num_tokens,
                                config->hidden));
    EPX_CHECK(check_row_align(buffer, op, "x", &args->x));
    EPX_CHECK(check_row_align(buffer, op, "out", &args->out));
    EPX_CHECK(check_wait_stats(buffer, op, &args->wait_recv_cost_stats));
    return EPX_SUCCESS;
}

epx_status_t epx__validate_ll_enabled(epx_buffer_t buffer, const char *op)
{
    return epx__check_ll_enabled(buffer, op);
}
