/*
 * epx_fanout_copy on the CUDA backend (include/epx_tool.h): one kernel (copy_fanout.cu)
 * on the caller's stream, writing into the peers' combine-input regions through the
 * CUDA IPC mapping of normal mode.
 */
#include <string.h>

#include "ops/cuda/cuda_backend.h"

epx_status_t epx__cuda_fanout_copy(epx_buffer_t buffer, const epx_fanout_args_t *args,
                                   void *stream)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__cuda_fanout_args_t f;
    memset(&f, 0, sizeof(f));
    f.src = args->src;
    f.src_pitch = args->src_pitch;
    f.rows = args->rows;
    f.row_bytes = args->row_bytes;
    f.fanout_milli = epx__fanout_milli(args->fanout);
    f.dst_offset = cuda->shape.off_combine_input;
    f.dst_pitch = cuda->shape.hidden * 2;
    f.first_row = (int64_t)buffer->group->rank * buffer->config.max_tokens_per_rank;
    f.stages = args->stages;
    f.kernel = args->kernel;
    f.num_sms = args->num_sms;
    EPX_CUDA_CHECK(epx__cuda_launch_fanout(&cuda->shape, &f, (cudaStream_t)stream),
                   "fanout_copy: launching the %s copy (stages %d)",
                   args->kernel == EPX_FANOUT_BULK     ? "bulk"
                   : args->kernel == EPX_FANOUT_STAGED ? "staged"
                                                       : "vector",
                   args->stages);
    return EPX_SUCCESS;
}
