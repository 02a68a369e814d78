/* tests/gpu/cuda_ll: one step's inputs and expected results (host), and its device memory. */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda_ll.h"

/* ---------------------------------------------------------------- one step, host side */


/* Inputs of one step, and what the oracle says this rank must receive and combine. */

int64_t rows_of(const shape_t *shape)
{
    return shape->max_tokens * g_world;
}

void step_make(step_t *s, const shape_t *shape, uint64_t seed, moe_ll_cast_t cast,
                      const uint8_t *mask)
{
    memset(s, 0, sizeof(*s));
    s->shape = *shape;
    s->cast = cast;
    s->mask = mask;
    moe_case_t c = {g_world, shape->tokens, shape->hidden, shape->experts_per_rank * g_world,
                    shape->topk, EPX_DTYPE_BF16, 1, seed, MOE_ROUTING_RANDOM, 0.1, -1, 0, 0, 0};
    s->c = c;
    if (moe_ll_inputs_make(&s->c, g_rank, &s->in) != 0 ||
        moe_ll_oracle_dispatch(&s->c, g_rank, shape->max_tokens, mask, cast, &s->e) != 0) {
        fprintf(stderr, "cuda_ll: rank %d: out of memory for the oracle\n", g_rank);
        exit(1);
    }
    int64_t total = 0, rows = s->e.rows, hidden = shape->hidden;
    for (int local = 0; local < s->e.num_local; local++)
        total += s->e.count[local];
    s->y = malloc((size_t)(total * hidden) * 2 + 2);
    if (s->y == NULL)
        exit(1);
    int64_t at = 0;
    for (int local = 0; local < s->e.num_local; local++)
        for (int64_t i = 0; i < s->e.count[local]; i++, at++) {
            int64_t row = local * rows + i;
            moe_ll_expert_row(&s->c, (int64_t)g_rank * s->e.num_local + local, s->e.src_rank[row],
                              s->e.src_token[row], s->y + at * hidden);
        }
    int64_t masked = 0;
    if (moe_ll_oracle_combine(&s->c, g_rank, mask, &s->want, &masked) != 0)
        exit(1);
}

void step_free(step_t *s)
{
    moe_inputs_free(&s->in);
    moe_ll_expected_free(&s->e);
    free(s->y);
    free(s->want);
    memset(s, 0, sizeof(*s));
}

/* ---------------------------------------------------------------- device memory */

/* The tensors one step reads and writes, in device memory (the captured ones in graphs). */

void *device_alloc(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes > 0 ? bytes : 16));
    return p;
}

void io_alloc(io_t *io, const shape_t *shape)
{
    int64_t t = shape->tokens, h = shape->hidden, k = shape->topk;
    io->x_bytes = (size_t)(t * h) * 2;
    io->idx_bytes = (size_t)(t * k) * 8;
    io->weights_bytes = (size_t)(t * k) * 4;
    io->y_bytes = (size_t)((int64_t)shape->experts_per_rank * rows_of(shape) * h) * 2;
    io->out_bytes = (size_t)(t * h) * 2;
    io->x = device_alloc(io->x_bytes);
    io->idx = device_alloc(io->idx_bytes);
    io->weights = device_alloc(io->weights_bytes);
    io->y = device_alloc(io->y_bytes);
    io->out = device_alloc(io->out_bytes);
    CUDA_OK(cudaMemset(io->y, 0, io->y_bytes));
}

void io_free(io_t *io)
{
    cudaFree(io->x);
    cudaFree(io->idx);
    cudaFree(io->weights);
    cudaFree(io->y);
    cudaFree(io->out);
    memset(io, 0, sizeof(*io));
}

/* The step's expert outputs into `dst` [L][M * R][hidden] bf16 (device), in stream order. */
void upload_expert_outputs(void *dst, const step_t *s)
{
    int64_t rows = s->e.rows, hidden = s->shape.hidden, at = 0;
    for (int local = 0; local < s->e.num_local; local++) {
        int64_t n = s->e.count[local];
        if (n > 0)
            CUDA_OK(cudaMemcpyAsync((char *)dst + (size_t)(local * rows * hidden) * 2,
                                    s->y + at * hidden, (size_t)(n * hidden) * 2,
                                    cudaMemcpyHostToDevice, g_stream));
        at += n;
    }
}

/* The step's inputs and expert outputs into `io`, and NaN bits into its output. */
void io_upload(io_t *io, const step_t *s)
{
    CUDA_OK(cudaMemcpyAsync(io->x, s->in.x, io->x_bytes, cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaMemcpyAsync(io->idx, s->in.topk_idx, io->idx_bytes, cudaMemcpyHostToDevice,
                            g_stream));
    CUDA_OK(cudaMemcpyAsync(io->weights, s->in.topk_weights, io->weights_bytes,
                            cudaMemcpyHostToDevice, g_stream));
    upload_expert_outputs(io->y, s);
    CUDA_OK(cudaMemsetAsync(io->out, 0xff, io->out_bytes, g_stream));
}

epx_ll_dispatch_args_t dispatch_args(const io_t *io, const shape_t *shape,
                                            moe_ll_cast_t cast, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(io->x, EPX_DTYPE_BF16, shape->tokens, shape->hidden);
    args.topk_idx = epx_tensor_2d(io->idx, EPX_DTYPE_INT64, shape->tokens, shape->topk);
    args.use_fp8 = cast.use_fp8;
    args.round_scale = cast.round_scale;
    args.use_ue8m0 = cast.use_ue8m0;
    args.flags = flags;
    return args;
}

/* A [L, M * R, hidden] bf16 tensor over `data` (io->y, or the zero-copy view's memory). */
epx_tensor_t expert_tensor(void *data, const shape_t *shape)
{
    epx_tensor_t t = EPX_TENSOR_NONE;
    t.data = data;
    t.dtype = EPX_DTYPE_BF16;
    t.ndim = 3;
    t.shape[0] = shape->experts_per_rank;
    t.shape[1] = rows_of(shape);
    t.shape[2] = shape->hidden;
    return t;
}

epx_ll_combine_args_t combine_args(const io_t *io, const shape_t *shape,
                                          epx_ll_handle_t handle, epx_tensor_t x, uint32_t flags)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = x;
    args.topk_idx = epx_tensor_2d(io->idx, EPX_DTYPE_INT64, shape->tokens, shape->topk);
    args.topk_weights = epx_tensor_2d(io->weights, EPX_DTYPE_FP32, shape->tokens, shape->topk);
    args.out = epx_tensor_2d(io->out, EPX_DTYPE_BF16, shape->tokens, shape->hidden);
    args.flags = flags;
    return args;
}

/* The zero-copy combine input of `handle`, checked to be [L, M * R, hidden] bf16. */
int combine_view(epx_buffer_t buffer, epx_ll_handle_t handle, const shape_t *shape,
                        const char *what, epx_tensor_t *view)
{
    epx_status_t status = epx_ll_get_combine_buffer(buffer, handle, view);
    if (status != EPX_SUCCESS) {
        fail(what, "epx_ll_get_combine_buffer: %s: %s", epx_status_name(status), epx_last_error());
        return -1;
    }
    if (view->data == NULL || view->dtype != EPX_DTYPE_BF16 || view->ndim != 3 ||
        view->shape[0] != shape->experts_per_rank || view->shape[1] != rows_of(shape) ||
        view->shape[2] != shape->hidden ||
        (view->strides[0] != 0 && view->strides[0] != rows_of(shape) * shape->hidden) ||
        (view->strides[1] != 0 && view->strides[1] != shape->hidden)) {
        fail(what, "combine buffer view is %p %s ndim %d [%lld, %lld, %lld], expected bf16 "
             "[%d, %lld, %lld] contiguous", view->data, epx_dtype_name(view->dtype), view->ndim,
             (long long)view->shape[0], (long long)view->shape[1], (long long)view->shape[2],
             shape->experts_per_rank, (long long)rows_of(shape), (long long)shape->hidden);
        return -1;
    }
    return 0;
}
