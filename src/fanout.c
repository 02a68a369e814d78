/*
 * Tool support entry points (include/epx_tool.h): epx_fanout_copy, the fan-out copy of
 * normal-mode dispatch alone, and epx_fanin_reduce, the fan-in sum of its combine alone,
 * for `epx bench --mode fanout`. Both check their arguments the same way (the rows of
 * this rank's memory, their count and size, the sources or destinations per row, the SM
 * budget) and hand the work to the backend.
 */
#include <stdint.h>

#include "api.h"
#include "core/objects.h"
#include "epx_tool.h"

/* The rows on this rank's side of a copy or a sum: `mem` (named `mem_name`), `rows` rows
 * of `row_bytes` `pitch` bytes apart (named `pitch_name`; 0 = row_bytes), `fan` ranks a
 * row on average (named `fan_name`), on `num_sms` SMs. `op` starts every message. */
typedef struct {
    const char *op;
    const char *mem_name;
    const void *mem;
    int64_t rows;
    int64_t row_bytes;
    const char *pitch_name;
    int64_t pitch;
    const char *fan_name;
    double fan;
    int num_sms;
} rows_shape_t;

static epx_status_t check_rows(epx_buffer_t buffer, const rows_shape_t *r)
{
    const epx_group_t group = buffer->group;
    if (r->mem == NULL)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s is NULL", r->op, r->mem_name);
    if ((uintptr_t)r->mem % 16 != 0)
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s %p is not 16-byte aligned", r->op,
                         r->mem_name, r->mem);
    if (r->rows < 0 || r->rows > buffer->config.max_tokens_per_rank)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: rows is %lld, expected 0 to max_tokens_per_rank %lld", r->op,
                         (long long)r->rows, (long long)buffer->config.max_tokens_per_rank);
    if (r->row_bytes <= 0 || r->row_bytes % 16 != 0 || r->row_bytes > buffer->config.hidden * 2)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: row_bytes is %lld, expected a positive multiple of 16 up to "
                         "hidden * 2 = %lld",
                         r->op, (long long)r->row_bytes, (long long)buffer->config.hidden * 2);
    if (r->pitch != 0 && (r->pitch < r->row_bytes || r->pitch % 16 != 0))
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: %s is %lld, expected 0 or a multiple of 16 of at least row_bytes "
                         "%lld",
                         r->op, r->pitch_name, (long long)r->pitch, (long long)r->row_bytes);
    if (!(r->fan >= 1.0 && r->fan <= (double)group->world_size))
        return EPX_ERROR(EPX_ERR_INVALID_ARG, "%s: %s is %g, expected 1 to world_size %d",
                         r->op, r->fan_name, r->fan, group->world_size);
    if (r->num_sms < 0 || r->num_sms > 1024)
        return EPX_ERROR(EPX_ERR_INVALID_ARG,
                         "%s: num_sms is %d, expected 0 (the buffer's) to 1024", r->op,
                         r->num_sms);
    return EPX_SUCCESS;
}

/* The buffer can run the operation: usable, on one node (`what` says why), a backend that
 * has it (`has`). */
static epx_status_t check_buffer(epx_buffer_t buffer, const char *op, const char *what, int has)
{
    EPX_CHECK(epx__buffer_check_usable(buffer, op));
    if (buffer->group->ranks_per_node < buffer->group->world_size)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED,
                         "%s: the group spans nodes (%d ranks per node of %d); the %s is for "
                         "ranks that map each other's memory",
                         op, buffer->group->ranks_per_node, buffer->group->world_size, what);
    if (!has)
        return EPX_ERROR(EPX_ERR_UNSUPPORTED, "%s: not supported by the %s backend", op,
                         buffer->ops->name);
    return EPX_SUCCESS;
}

/* ---------------------------------------------------------------- fan-out copy */

static epx_status_t check_fanout_args(epx_buffer_t buffer, const epx_fanout_args_t *args)
{
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
    const rows_shape_t shape = {.op = "fanout_copy", .mem_name = "src", .mem = args->src,
                                .rows = args->rows, .row_bytes = args->row_bytes,
                                .pitch_name = "src_pitch", .pitch = args->src_pitch,
                                .fan_name = "fanout", .fan = args->fanout,
                                .num_sms = args->num_sms};
    EPX_CHECK(check_rows(buffer, &shape));
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
    EPX_CHECK(check_fanout_args(buffer, args));
    EPX_CHECK(check_buffer(buffer, "fanout_copy", "copy", buffer->ops->fanout_copy != NULL));
    epx_fanout_args_t resolved = *args;
    if (resolved.src_pitch == 0)
        resolved.src_pitch = resolved.row_bytes;
    if (resolved.num_sms == 0)
        resolved.num_sms = buffer->config.num_sms;
    return buffer->ops->fanout_copy(buffer, &resolved, stream);
}

/* ---------------------------------------------------------------- fan-in sum */

static epx_status_t check_fanin_args(epx_buffer_t buffer, const epx_fanin_args_t *args)
{
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
    const rows_shape_t shape = {.op = "fanin_reduce", .mem_name = "dst", .mem = args->dst,
                                .rows = args->rows, .row_bytes = args->row_bytes,
                                .pitch_name = "dst_pitch", .pitch = args->dst_pitch,
                                .fan_name = "fanin", .fan = args->fanin,
                                .num_sms = args->num_sms};
    return check_rows(buffer, &shape);
}

epx_status_t epx_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args, void *stream)
{
    epx__clear_error();
    EPX_CHECK(epx__object_check(EPX__OBJECT_BUFFER, buffer, "fanin_reduce", "buffer"));
    EPX_CHECK(check_fanin_args(buffer, args));
    EPX_CHECK(check_buffer(buffer, "fanin_reduce", "sum", buffer->ops->fanin_reduce != NULL));
    epx_fanin_args_t resolved = *args;
    if (resolved.dst_pitch == 0)
        resolved.dst_pitch = resolved.row_bytes;
    if (resolved.num_sms == 0)
        resolved.num_sms = buffer->config.num_sms;
    return buffer->ops->fanin_reduce(buffer, &resolved, stream);
}
