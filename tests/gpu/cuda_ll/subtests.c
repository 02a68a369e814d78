/* tests/gpu/cuda_ll: the sub-tests (see main.c). */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda_ll.h"

/* ---------------------------------------------------------------- sub-tests */

const shape_t small_shape = {16, 16, 512, 4, 4};
int g_replays = 100, g_split_replays = 20;
uint64_t g_seed = 1;

void destroy_buffer(epx_buffer_t buffer, const char *what)
{
    epx_status_t status = epx_buffer_destroy(buffer);
    if (status != EPX_SUCCESS)
        fail(what, "epx_buffer_destroy: %s: %s", epx_status_name(status), epx_last_error());
}

/* Combine `x` (the zero-copy view or a tensor) and, when split, receive it. */
epx_status_t combine_step(epx_buffer_t buffer, const io_t *io, const shape_t *shape,
                                 epx_ll_handle_t handle, epx_tensor_t x, uint32_t flags)
{
    epx_ll_combine_args_t args = combine_args(io, shape, handle, x, flags);
    epx_status_t status = epx_ll_combine(buffer, &args, NULL, g_stream);
    if (status == EPX_SUCCESS && (flags & EPX_LL_SEND_ONLY))
        status = epx_ll_receive(buffer, handle, g_stream);
    return status;
}

/* Dispatch and, when split, receive it. */
epx_status_t dispatch_step(epx_buffer_t buffer, const io_t *io, const shape_t *shape,
                                  moe_ll_cast_t cast, uint32_t flags,
                                  epx_ll_dispatch_result_t *result)
{
    epx_ll_dispatch_args_t args = dispatch_args(io, shape, cast, flags);
    *result = (epx_ll_dispatch_result_t)EPX_LL_DISPATCH_RESULT_INIT;
    epx_status_t status = epx_ll_dispatch(buffer, &args, result, g_stream);
    if (status == EPX_SUCCESS && (flags & EPX_LL_SEND_ONLY))
        status = epx_ll_receive(buffer, result->handle, g_stream);
    return status;
}

/*
 * One step captured in a CUDA graph and replayed `replays` times with fresh inputs. The
 * captured tensors (io) stay; before each replay the step's inputs and expert outputs
 * are copied into them on the capture stream, and after it the results come back. A
 * warm-up step outside the graph comes first (as frameworks do before capturing); it
 * takes the other slot, so the graph's step always uses the same slot.
 */
void graph_test(const char *name, moe_ll_cast_t cast, int split, int replays)
{
    const shape_t *shape = &small_shape;
    uint32_t flags = split ? EPX_LL_SEND_ONLY : 0;
    char what[160];
    epx_buffer_t buffer = make_buffer(shape);
    io_t io;
    io_alloc(&io, shape);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    int capturing = 0;
    step_t s;
    epx_ll_dispatch_result_t res;
    epx_tensor_t view;

    snprintf(what, sizeof(what), "%s: warm-up step", name);
    step_make(&s, shape, g_seed * 1000 + 999, cast, NULL);
    if (any_failure())
        goto done;
    io_upload(&io, &s);
    EPX_TRY(dispatch_step(buffer, &io, shape, cast, flags, &res), captured);
    check_dispatch(what, &s, &res);
    EPX_TRY(combine_step(buffer, &io, shape, res.handle, expert_tensor(io.y, shape), flags),
            captured);
    check_combine(what, &s, io.out);
    check_buffer_state(what, buffer, NULL);

    /* dispatch [receive], copy into the combine buffer, combine [receive] */
    snprintf(what, sizeof(what), "%s: capture", name);
    CUDA_OK(cudaStreamSynchronize(g_stream));
    CUDA_OK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
    capturing = 1;
    EPX_TRY(dispatch_step(buffer, &io, shape, cast, flags, &res), captured);
    if (combine_view(buffer, res.handle, shape, what, &view) != 0)
        goto captured;
    CUDA_OK(cudaMemcpyAsync(view.data, io.y, io.y_bytes, cudaMemcpyDeviceToDevice, g_stream));
    EPX_TRY(combine_step(buffer, &io, shape, res.handle, view, flags), captured);
    capturing = 0;
    CUDA_OK(cudaStreamEndCapture(g_stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
captured:
    if (capturing) {
        /* End the broken capture so that the stream is usable again. */
        cudaGraph_t broken = NULL;
        cudaStreamEndCapture(g_stream, &broken);
        if (broken != NULL)
            cudaGraphDestroy(broken);
        cudaGetLastError();
    }
    CUDA_OK(cudaStreamSynchronize(g_stream));
    step_free(&s);

    for (int replay = 0; replay < replays; replay++) {
        snprintf(what, sizeof(what), "%s: replay %d of %d", name, replay + 1, replays);
        step_make(&s, shape, g_seed * 1000 + (uint64_t)replay, cast, NULL);
        if (any_failure())
            break;
        io_upload(&io, &s);
        CUDA_OK(cudaGraphLaunch(exec, g_stream));
        check_dispatch(what, &s, &res);
        check_combine(what, &s, io.out);
        check_buffer_state(what, buffer, NULL);
        step_free(&s);
    }
done:
    CUDA_OK(cudaStreamSynchronize(g_stream));
    step_free(&s);
    if (exec != NULL)
        CUDA_OK(cudaGraphExecDestroy(exec));
    if (graph != NULL)
        CUDA_OK(cudaGraphDestroy(graph));
    io_free(&io);
    destroy_buffer(buffer, name);
}

void test_graph_fp8(void)
{
    moe_ll_cast_t fp8 = {1, 0, 0};
    graph_test("graph fp8", fp8, 0, g_replays);
}

void test_graph_split(void)
{
    moe_ll_cast_t fp8 = {1, 0, 0};
    graph_test("graph fp8 split", fp8, 1, g_split_replays);
}

void test_graph_bf16(void)
{
    moe_ll_cast_t bf16 = {0, 0, 0};
    graph_test("graph bf16", bf16, 0, 3);
}

/*
 * Two steps in flight outside graphs: dispatch A and B (send-only), receive A and B,
 * combine A through the zero-copy buffer and B from a separate tensor: blocking in round
 * 0; in later rounds both combines send-only (one operation in flight per slot), then
 * received in order. Every round reuses both slots.
 */
void test_overlap(void)
{
    const shape_t *shape = &small_shape;
    moe_ll_cast_t fp8 = {1, 0, 0}, bf16 = {0, 0, 0};
    epx_buffer_t buffer = make_buffer(shape);
    io_t io_a, io_b;
    io_alloc(&io_a, shape);
    io_alloc(&io_b, shape);
    step_t a, b;
    char what_a[96], what_b[96];
    for (int round = 0; round < 3; round++) {
        uint32_t combine_flags = round == 0 ? 0 : EPX_LL_SEND_ONLY;
        snprintf(what_a, sizeof(what_a), "overlap round %d, step A (fp8)", round);
        snprintf(what_b, sizeof(what_b), "overlap round %d, step B (bf16)", round);
        step_make(&a, shape, g_seed * 2000 + (uint64_t)round * 2, fp8, NULL);
        step_make(&b, shape, g_seed * 2000 + (uint64_t)round * 2 + 1, bf16, NULL);
        if (any_failure()) {
            step_free(&a);
            step_free(&b);
            break;
        }
        io_upload(&io_a, &a);
        io_upload(&io_b, &b);
        epx_ll_dispatch_args_t args_a = dispatch_args(&io_a, shape, fp8, EPX_LL_SEND_ONLY);
        epx_ll_dispatch_args_t args_b = dispatch_args(&io_b, shape, bf16, EPX_LL_SEND_ONLY);
        epx_ll_dispatch_result_t res_a = EPX_LL_DISPATCH_RESULT_INIT;
        epx_ll_dispatch_result_t res_b = EPX_LL_DISPATCH_RESULT_INIT;
        epx_tensor_t view;
        EPX_TRY(epx_ll_dispatch(buffer, &args_a, &res_a, g_stream), next_round);
        EPX_TRY(epx_ll_dispatch(buffer, &args_b, &res_b, g_stream), next_round);
        EPX_TRY(epx_ll_receive(buffer, res_a.handle, g_stream), next_round);
        EPX_TRY(epx_ll_receive(buffer, res_b.handle, g_stream), next_round);
        check_dispatch(what_a, &a, &res_a);
        check_dispatch(what_b, &b, &res_b);

        if (combine_view(buffer, res_a.handle, shape, what_a, &view) != 0)
            goto next_round;
        CUDA_OK(cudaMemcpyAsync(view.data, io_a.y, io_a.y_bytes, cudaMemcpyDeviceToDevice,
                                g_stream));
        epx_ll_combine_args_t comb_a = combine_args(&io_a, shape, res_a.handle, view,
                                                    combine_flags);
        epx_ll_combine_args_t comb_b = combine_args(&io_b, shape, res_b.handle,
                                                    expert_tensor(io_b.y, shape), combine_flags);
        EPX_TRY(epx_ll_combine(buffer, &comb_a, NULL, g_stream), next_round);
        EPX_TRY(epx_ll_combine(buffer, &comb_b, NULL, g_stream), next_round);
        if (combine_flags & EPX_LL_SEND_ONLY) {
            EPX_TRY(epx_ll_receive(buffer, res_a.handle, g_stream), next_round);
            EPX_TRY(epx_ll_receive(buffer, res_b.handle, g_stream), next_round);
        }
        check_combine(what_a, &a, io_a.out);
        check_combine(what_b, &b, io_b.out);
        check_buffer_state(what_b, buffer, NULL);
    next_round:
        CUDA_OK(cudaStreamSynchronize(g_stream)); /* the copies from a and b are done */
        step_free(&a);
        step_free(&b);
    }
    CUDA_OK(cudaStreamSynchronize(g_stream));
    io_free(&io_a);
    io_free(&io_b);
    destroy_buffer(buffer, "overlap");
}

/*
 * Rank `lost` sits the steps out (as a failed peer would); every other rank masks it
 * first. Its rows are absent from the dispatch and its experts combine as zeros, as the
 * oracle with the mask says. The lost rank joins only the host meetings between steps.
 */
void test_masked(void)
{
    const shape_t *shape = &small_shape;
    int lost = g_world / 2, alive = g_rank != lost;
    uint8_t *mask = calloc((size_t)g_world, 1);
    if (mask == NULL)
        exit(1);
    mask[lost] = 1;
    moe_ll_cast_t casts[3] = {{1, 0, 0}, {1, 1, 1}, {0, 0, 0}};
    epx_buffer_t buffer = make_buffer(shape);
    io_t io;
    io_alloc(&io, shape);
    step_t s;
    char what[96];
    if (alive) {
        check_buffer_state("masked rank: before masking", buffer, NULL);
        EPX_TRY(epx_ll_mask_rank(buffer, lost), steps);
        check_buffer_state("masked rank: after epx_ll_mask_rank", buffer, mask);
    }
steps:
    for (int step = 0; step < 3; step++) {
        /* Step 1 splits dispatch and combine; step 2 combines from a separate tensor. */
        uint32_t flags = step == 1 ? EPX_LL_SEND_ONLY : 0;
        snprintf(what, sizeof(what), "masked rank %d: step %d (%s%s)", lost, step,
                 casts[step].use_fp8 ? (casts[step].use_ue8m0 ? "fp8 ue8m0" : "fp8") : "bf16",
                 flags ? ", split" : "");
        memset(&s, 0, sizeof(s));
        if (alive)
            step_make(&s, shape, g_seed * 3000 + (uint64_t)step, casts[step], mask);
        if (any_failure()) {
            step_free(&s);
            break;
        }
        if (!alive)
            continue;
        io_upload(&io, &s);
        epx_ll_dispatch_result_t res;
        epx_tensor_t x = expert_tensor(io.y, shape);
        EPX_TRY(dispatch_step(buffer, &io, shape, casts[step], flags, &res), next_step);
        check_dispatch(what, &s, &res);
        if (step != 2) {
            if (combine_view(buffer, res.handle, shape, what, &x) != 0)
                goto next_step;
            CUDA_OK(cudaMemcpyAsync(x.data, io.y, io.y_bytes, cudaMemcpyDeviceToDevice,
                                    g_stream));
        }
        EPX_TRY(combine_step(buffer, &io, shape, res.handle, x, flags), next_step);
        check_combine(what, &s, io.out);
        check_buffer_state(what, buffer, mask);
    next_step:
        CUDA_OK(cudaStreamSynchronize(g_stream));
        step_free(&s);
    }
    CUDA_OK(cudaStreamSynchronize(g_stream));
    io_free(&io);
    destroy_buffer(buffer, "masked rank");
    free(mask);
}

/* docs/DESIGN.md section 5's low-latency case, fp8, checked once (the oracle takes a while). */
void test_standard(void)
{
    shape_t shape = {128, 128, 7168, 256 / g_world, 8};
    moe_ll_cast_t fp8 = {1, 0, 0};
    const char *what = "standard case";
    epx_buffer_t buffer = make_buffer(&shape);
    io_t io;
    memset(&io, 0, sizeof(io));
    /* No y staging tensor: the expert outputs go straight into the combine buffer. */
    int64_t t = shape.tokens, h = shape.hidden, k = shape.topk;
    io.x_bytes = (size_t)(t * h) * 2;
    io.idx_bytes = (size_t)(t * k) * 8;
    io.weights_bytes = (size_t)(t * k) * 4;
    io.out_bytes = (size_t)(t * h) * 2;
    io.x = device_alloc(io.x_bytes);
    io.idx = device_alloc(io.idx_bytes);
    io.weights = device_alloc(io.weights_bytes);
    io.out = device_alloc(io.out_bytes);
    step_t s;
    epx_ll_dispatch_result_t res;
    epx_tensor_t view;
    step_make(&s, &shape, g_seed * 4000, fp8, NULL);
    if (any_failure())
        goto done;
    CUDA_OK(cudaMemcpyAsync(io.x, s.in.x, io.x_bytes, cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaMemcpyAsync(io.idx, s.in.topk_idx, io.idx_bytes, cudaMemcpyHostToDevice,
                            g_stream));
    CUDA_OK(cudaMemcpyAsync(io.weights, s.in.topk_weights, io.weights_bytes,
                            cudaMemcpyHostToDevice, g_stream));
    CUDA_OK(cudaMemsetAsync(io.out, 0xff, io.out_bytes, g_stream));
    EPX_TRY(dispatch_step(buffer, &io, &shape, fp8, 0, &res), done);
    check_dispatch(what, &s, &res);
    if (combine_view(buffer, res.handle, &shape, what, &view) != 0)
        goto done;
    upload_expert_outputs(view.data, &s);
    EPX_TRY(combine_step(buffer, &io, &shape, res.handle, view, 0), done);
    check_combine(what, &s, io.out);
    check_buffer_state(what, buffer, NULL);
done:
    CUDA_OK(cudaStreamSynchronize(g_stream));
    step_free(&s);
    io_free(&io);
    destroy_buffer(buffer, what);
}

/*
 * Rejoin is the CPU backend's alone: on the CUDA backend epx_ll_rejoin and
 * epx_buffer_create_rejoin return EPX_ERR_UNSUPPORTED naming NVSHMEM, and change nothing
 * (docs/STABILITY.md). The new group is each rank's own group of one, so no rendezvous is
 * needed; the refusal comes before the agreement.
 */
void test_rejoin_unsupported(void)
{
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    epx_group_t solo = NULL;
    epx_buffer_t buffer = make_buffer(&small_shape), other = NULL;
    EPX_TRY(epx_group_get_info(g_group, &info), done);
    config.backend = EPX_BACKEND_CUDA;
    config.device = info.device;
    EPX_TRY(epx_group_create(&config, &solo), done);
    epx_status_t status = epx_ll_rejoin(buffer, solo);
    if (status != EPX_ERR_UNSUPPORTED || strstr(epx_last_error(), "NVSHMEM") == NULL)
        fail("epx_ll_rejoin", "returned %s (%s), expected EPX_ERR_UNSUPPORTED naming NVSHMEM",
             epx_status_name(status), epx_last_error());
    epx_buffer_config_t buffer_config = EPX_BUFFER_CONFIG_INIT;
    buffer_config.max_tokens_per_rank = small_shape.max_tokens;
    buffer_config.hidden = small_shape.hidden;
    buffer_config.num_experts = small_shape.experts_per_rank;
    buffer_config.num_topk = small_shape.topk;
    buffer_config.max_low_latency_tokens = small_shape.max_tokens;
    status = epx_buffer_create_rejoin(solo, &buffer_config, &other);
    if (status != EPX_ERR_UNSUPPORTED || other != NULL)
        fail("epx_buffer_create_rejoin", "returned %s (%s), expected EPX_ERR_UNSUPPORTED",
             epx_status_name(status), epx_last_error());
    check_buffer_state("rejoin refused: the buffer as before", buffer, NULL);
done:
    if (solo != NULL)
        epx_group_destroy(solo);
    any_failure();
    destroy_buffer(buffer, "rejoin unsupported");
}
