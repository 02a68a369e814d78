/*
 * epx_fanin_reduce on the CUDA backend (include/epx_tool.h): one kernel (reduce_fanin.cu)
 * on the caller's stream, reading the peers' combine-input regions through the CUDA IPC
 * mapping of normal mode.
 */
#include <string.h>

#include "ops/cuda/cuda_backend.h"

epx_status_t epx__cuda_fanin_reduce(epx_buffer_t buffer, const epx_fanin_args_t *args,
                                    void *stream)
{
    epx__cuda_buffer_t *cuda = buffer->impl;
    epx__cuda_fanin_args_t f;
    memset(&f, 0, sizeof(f));
    f.dst = args->dst;
    f.dst_pitch = args->dst_pitch;
    f.rows = args->rows;
    f.row_bytes = args->row_bytes;
    f.fanin_milli = epx__fanout_milli(args->fanin);
    f.src_offset = cuda->shape.off_combine_input;
    f.src_pitch = cuda->shape.hidden * 2;
    f.first_row = (int64_t)buffer->group->rank * buffer->config.max_tokens_per_rank;
    f.kernel = args->kernel;
    f.num_sms = args->num_sms;
    EPX_CUDA_CHECK(epx__cuda_launch_fanin(&cuda->shape, &f, (cudaStream_t)stream),
                   "fanin_reduce: launching the vector sum (fanin %g, %d SMs)", args->fanin,
                   args->num_sms);
    return EPX_SUCCESS;
}
