/*
 * `epx bench --mode ll`: the low-latency calls of one case (bench_ll_case.h), each
 * checked for success (a failure ends the run with the library's message).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_ll.h"
#include "bench_ll_case.h"
#include "moe_ll.h"

int epx__bench_ll_is_fp8(const ll_case_t *lc)
{
    return lc->cast.use_fp8;
}

void *epx__bench_ll_host_alloc(const ll_case_t *lc, size_t bytes, const char *what)
{
    void *memory = calloc(1, bytes > 0 ? bytes : 1);
    if (memory == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory (%s)\n", lc->rank, what);
        exit(1);
    }
    return memory;
}

/* ---------------------------------------------------------------- ops */

epx_ll_dispatch_result_t epx__bench_ll_run_dispatch(ll_case_t *lc, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(lc->x, EPX_DTYPE_BF16, lc->inputs.num_tokens, lc->moe.hidden);
    args.topk_idx =
        epx_tensor_2d(lc->topk_idx, EPX_DTYPE_INT64, lc->inputs.num_tokens, lc->moe.num_topk);
    args.use_fp8 = lc->cast.use_fp8;
    args.round_scale = lc->cast.round_scale;
    args.use_ue8m0 = lc->cast.use_ue8m0;
    args.flags = flags;
    if (lc->wait_stats[0] != NULL)
        args.wait_recv_cost_stats = epx_tensor_1d(lc->wait_stats[0], EPX_DTYPE_INT64, lc->world_size);
    epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
    epx__bench_must(lc->rank, epx_ll_dispatch(lc->buffer, &args, &result, lc->device->stream),
                    flags & EPX_LL_SEND_ONLY ? "epx_ll_dispatch (EPX_LL_SEND_ONLY)"
                                             : "epx_ll_dispatch");
    return result;
}

void epx__bench_ll_run_receive(ll_case_t *lc, epx_ll_handle_t handle, const char *what)
{
    epx__bench_must(lc->rank, epx_ll_receive(lc->buffer, handle, lc->device->stream), what);
}

void epx__bench_ll_run_combine(ll_case_t *lc, epx_ll_handle_t handle, const epx_tensor_t *x,
                        uint32_t flags)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = handle;
    args.x = *x;
    args.topk_idx =
        epx_tensor_2d(lc->topk_idx, EPX_DTYPE_INT64, lc->inputs.num_tokens, lc->moe.num_topk);
    args.topk_weights =
        epx_tensor_2d(lc->topk_weights, EPX_DTYPE_FP32, lc->inputs.num_tokens, lc->moe.num_topk);
    args.out = epx_tensor_2d(lc->out, EPX_DTYPE_BF16, lc->inputs.num_tokens, lc->moe.hidden);
    args.flags = flags;
    if (lc->wait_stats[1] != NULL)
        args.wait_recv_cost_stats = epx_tensor_1d(lc->wait_stats[1], EPX_DTYPE_INT64, lc->world_size);
    epx__bench_must(lc->rank, epx_ll_combine(lc->buffer, &args, NULL, lc->device->stream),
                    flags & EPX_LL_SEND_ONLY ? "epx_ll_combine (EPX_LL_SEND_ONLY)"
                                             : "epx_ll_combine");
}

/*
 * The step's zero-copy combine input, holding the expert outputs: a contiguous bf16
 * [L, M * R, hidden] view, expert l's received rows at its start.
 */
epx_tensor_t epx__bench_ll_combine_input(ll_case_t *lc, epx_ll_handle_t handle)
{
    epx_tensor_t view = EPX_TENSOR_NONE;
    epx__bench_must(lc->rank, epx_ll_get_combine_buffer(lc->buffer, handle, &view),
                    "epx_ll_get_combine_buffer");
    if (view.data == lc->filled[0] || view.data == lc->filled[1])
        return view;
    if (view.ndim != 3 || view.dtype != EPX_DTYPE_BF16 || view.shape[0] != lc->num_local ||
        view.shape[1] != lc->rows || view.shape[2] != lc->moe.hidden) {
        fprintf(stderr, "epx bench: %s: the combine buffer is a %s view of %d dims, expected "
                        "bf16 [%d, %lld, %lld]\n",
                lc->label, epx_dtype_name(view.dtype), view.ndim, lc->num_local,
                (long long)lc->rows, (long long)lc->moe.hidden);
        exit(1);
    }
    size_t row_bytes = (size_t)lc->moe.hidden * 2;
    for (int l = 0; l < lc->num_local; l++) {
        char *expert = (char *)view.data + (size_t)l * (size_t)lc->rows * row_bytes;
        epx__bench_must(lc->rank,
                        epx__bench_copy_in(lc->device, expert,
                                           lc->expert_out + lc->expert_first[l] * lc->moe.hidden,
                                           (size_t)lc->recv_count[l] * row_bytes),
                        "bench copy into the combine buffer");
    }
    if (lc->filled[0] == NULL)
        lc->filled[0] = view.data;
    else
        lc->filled[1] = view.data;
    return view;
}
