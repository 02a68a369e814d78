/*
 * Tool support entry point (include/epx_tool.h): epx_fanout_copy, the fan-out copy of
 * normal-mode dispatch alone, for `epx bench --mode fanout`. Checks the arguments and
 * hands the copy to the backend.
 */
#include <stdint.h>

#include "api.h"
#include "core/objects.h"
#include "epx_tool.h"

static epx_status_t check_args(epx_buffer_t buffer, const epx_fanout_args_t *args)
{
    const epx_group_t group = buffer->group;
    if (args == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "fanout_copy: args is NULL");
    if (args->size != sizeof(epx_fanout_args_t))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: args.size is %zu, expected %zu (fill args with "
                         "EPX_FANOUT_ARGS_INIT)",
                         args->size, sizeof(epx_fanout_args_t));
    if (args->kernel != EPX_FANOUT_VECTOR && args->kernel != EPX_FANOUT_BULK &&
        args->kernel != EPX_FANOUT_STAGED)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: kernel %d is not EPX_FANOUT_VECTOR (1), EPX_FANOUT_BULK "
                         "(2) or EPX_FANOUT_STAGED (3)",
                         (int)args->kernel);
    if (args->src == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "fanout_copy: src is NULL");
    if ((uintptr_t)args->src % 16 != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "fanout_copy: src %p is not 16-byte aligned",
                         args->src);
    if (args->rows < 0 || args->rows > buffer->config.max_tokens_per_rank)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: rows is %lld, expected 0 to max_tokens_per_rank %lld",
                         (long long)args->rows, (long long)buffer->config.max_tokens_per_rank);
    if (args->row_bytes <= 0 || args->row_bytes % 16 != 0 ||
        args->row_bytes > buffer->config.hidden * 2)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: row_bytes is %lld, expected a positive multiple of 16 up "
                         "to hidden * 2 = %lld",
                         (long long)args->row_bytes, (long long)buffer->config.hidden * 2);
    if (args->src_pitch != 0 && (args->src_pitch < args->row_bytes || args->src_pitch % 16 != 0))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: src_pitch is %lld, expected 0 or a multiple of 16 of at "
                         "least row_bytes %lld",
                         (long long)args->src_pitch, (long long)args->row_bytes);
    if (!(args->fanout >= 1.0 && args->fanout <= (double)group->world_size))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: fanout is %g, expected 1 to world_size %d", args->fanout,
                         group->world_size);
    if (args->num_sms < 0 || args->num_sms > 1024)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: num_sms is %d, expected 0 (the buffer's) to 1024",
                         args->num_sms);
    if (args->stages != 0 && (args->stages < 2 || args->stages > 8))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "fanout_copy: stages is %d, expected 0 (the default) or 2 to 8",
                         args->stages);
    return EPX_SUCCESS;
}

epx_status_t epx_fanout_copy(epx_buffer_t buffer, const epx_fanout_args_t *args, void *stream)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "fanout_copy", "buffer"));
    EPX_CHECK(check_args(buffer, args));
    EPX_CHECK(epx__buffer_check_usable(buffer, "fanout_copy"));
    if (buffer->group->ranks_per_node < buffer->group->world_size)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "fanout_copy: the group spans nodes (%d ranks per node of %d); the "
                         "copy is for ranks that map each other's memory",
                         buffer->group->ranks_per_node, buffer->group->world_size);
    if (buffer->ops->fanout_copy == NULL)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "fanout_copy: not supported by the %s backend",
                         buffer->ops->name);
    epx_fanout_args_t resolved = *args;
    if (resolved.src_pitch == 0)
        resolved.src_pitch = resolved.row_bytes;
    if (resolved.num_sms == 0)
        resolved.num_sms = buffer->config.num_sms;
    return buffer->ops->fanout_copy(buffer, &resolved, stream);
}
