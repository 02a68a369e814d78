/*
 * Tool support entry point (include/epx_tool.h): epx_fanin_reduce, the fan-in sum of
 * normal-mode combine alone, for `epx bench --mode fanout`'s fan-in rows. Checks the
 * arguments and hands the sum to the backend.
 */
#include <stdint.h>

#include "api.h"
#include "core/objects.h"
#include "epx_tool.h"

static epx_status_t check_args(epx_buffer_t buffer, const epx_fanin_args_t *args)
{
    const epx_group_t group = buffer->group;
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "fanin_reduce: args is NULL");
    if (args->size != sizeof(epx_fanin_args_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: args.size is %zu, expected %zu (fill args with "
                         "EPX_FANIN_ARGS_INIT)",
                         args->size, sizeof(epx_fanin_args_t));
    if (args->kernel != EPX_FANIN_VECTOR)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: kernel %d is not EPX_FANIN_VECTOR (1)",
                         (int)args->kernel);
    if (args->dst == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "fanin_reduce: dst is NULL");
    if ((uintptr_t)args->dst % 16 != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "fanin_reduce: dst %p is not 16-byte aligned",
                         args->dst);
    if (args->rows < 0 || args->rows > buffer->config.max_tokens_per_rank)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: rows is %lld, expected 0 to max_tokens_per_rank %lld",
                         (long long)args->rows, (long long)buffer->config.max_tokens_per_rank);
    if (args->row_bytes <= 0 || args->row_bytes % 16 != 0 ||
        args->row_bytes > buffer->config.hidden * 2)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: row_bytes is %lld, expected a positive multiple of 16 "
                         "up to hidden * 2 = %lld",
                         (long long)args->row_bytes, (long long)buffer->config.hidden * 2);
    if (args->dst_pitch != 0 && (args->dst_pitch < args->row_bytes || args->dst_pitch % 16 != 0))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: dst_pitch is %lld, expected 0 or a multiple of 16 of at "
                         "least row_bytes %lld",
                         (long long)args->dst_pitch, (long long)args->row_bytes);
    if (!(args->fanin >= 1.0 && args->fanin <= (double)group->world_size))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: fanin is %g, expected 1 to world_size %d", args->fanin,
                         group->world_size);
    if (args->num_sms < 0 || args->num_sms > 1024)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanin_reduce: num_sms is %d, expected 0 (the buffer's) to 1024",
                         args->num_sms);
    return EPX_SUCCESS;
}

epx_status_t epx_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args, void *stream)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "fanin_reduce", "buffer"));
    EPX_CHECK(check_args(buffer, args));
    EPX_CHECK(epx__buffer_check_usable(buffer, "fanin_reduce"));
    if (buffer->group->ranks_per_node < buffer->group->world_size)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "fanin_reduce: the group spans nodes (%d ranks per node of %d); the "
                         "sum is for ranks that map each other's memory",
                         buffer->group->ranks_per_node, buffer->group->world_size);
    if (buffer->ops->fanin_reduce == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "fanin_reduce: not supported by the %s backend",
                         buffer->ops->name);
    epx_fanin_args_t resolved = *args;
    if (resolved.dst_pitch == 0)
        resolved.dst_pitch = resolved.row_bytes;
    if (resolved.num_sms == 0)
        resolved.num_sms = buffer->config.num_sms;
    return buffer->ops->fanin_reduce(buffer, &resolved, stream);
}
