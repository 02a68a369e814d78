/*
 * Mistakes in the form of a normal-mode call (include/epx.h, "Errors"): refused on the
 * rank that made them before anything is exchanged, with no effect there. When every
 * rank makes the same mistake nobody waits and the buffer stays usable on all of them;
 * when one rank alone makes it, the others get EPX_ERR_REMOTE naming it, at once (on
 * the CPU backend; the CUDA backend has no way to refuse a call without taking part, so
 * it still fails the call on every rank and the buffer with it). Cached mode ignores
 * topk_idx and topk_weights.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bad_input.h"
#include "harness.h"
#include "mem.h"
#include "test_util.h"

/* The buffer still works: a fresh dispatch and combine on every rank succeed. */
static void expect_usable(bi_fixture_t *f, const char *after)
{
    epx_status_t error = EPX_SUCCESS;
    CHECK_OK(epx_get_async_error(f->buffer, &error, NULL, 0));
    if (error != EPX_SUCCESS)
        TEST_FAIL("rank %d: after %s the buffer has the async error %s", bi_info.rank, after,
                  epx_status_name(error));
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    epx_status_t got = epx_dispatch(f->buffer, &f->args, &result, NULL);
    if (got != EPX_SUCCESS)
        TEST_FAIL("rank %d: dispatch after %s returned %s: %s", bi_info.rank, after,
                  epx_status_name(got), epx_last_error());
    CHECK_OK(epx_handle_destroy(result.handle));
}

/* Every rank gives recv_x but not recv_topk_idx (outputs are all given or none). */
static void run_all_ranks_partial_outputs(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    int64_t rows = BI_MAX_TOKENS * bi_info.world_size;
    f.outputs[0] = mr_mem_alloc((size_t)(rows * BI_HIDDEN) * 2, 0);
    f.args.recv_x = epx_tensor_2d(f.outputs[0], EPX_DTYPE_BF16, rows, BI_HIDDEN);
    bi_expect("dispatch: every rank gives recv_x without recv_topk_idx",
              epx_dispatch(f.buffer, &f.args, &f.result, NULL), EPX_ERR_INVALID_ARG,
              "recv_topk_idx");
    CHECK(f.result.handle == NULL);
    f.args.recv_x = (epx_tensor_t)EPX_TENSOR_NONE;
    expect_usable(&f, "a partial set of outputs on every rank");
    bi_teardown(&f);
}

/* Every rank passes a wrong args.size, to dispatch and then to combine. */
static void run_all_ranks_wrong_size(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    f.args.size -= 8;
    bi_expect("dispatch: every rank passes a wrong args.size",
              epx_dispatch(f.buffer, &f.args, &f.result, NULL), EPX_ERR_INVALID_ARG, "size");
    f.args.size += 8;
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    int64_t recv = f.result.num_recv_tokens;
    void *x = mr_mem_alloc((size_t)(recv * BI_HIDDEN) * 2 + 2, 0);
    void *out = mr_mem_alloc((size_t)(BI_TOKENS * BI_HIDDEN) * 2, 0);
    args.handle = f.result.handle;
    args.x = epx_tensor_2d(x, EPX_DTYPE_FP32, recv, BI_HIDDEN / 2);
    args.out_x = epx_tensor_2d(out, EPX_DTYPE_BF16, BI_TOKENS, BI_HIDDEN);
    bi_expect("combine: every rank passes fp32 x", epx_combine(f.buffer, &args, NULL),
              EPX_ERR_INVALID_ARG, "x");
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, recv, BI_HIDDEN);
    CHECK_OK(epx_combine(f.buffer, &args, NULL));
    CHECK_OK(epx_handle_destroy(f.result.handle));
    mr_mem_free(x);
    mr_mem_free(out);
    expect_usable(&f, "wrong args on every rank");
    bi_teardown(&f);
}

/* Cached mode with topk_idx and topk_weights still given: accepted, and ignored. */
static void run_cached_with_routing(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    epx_handle_t handle = f.result.handle;
    int64_t recv = f.result.num_recv_tokens;
    size_t bytes = (size_t)(recv * BI_HIDDEN) * 2;
    void *fresh_rows = malloc(bytes + 2), *cached_rows = malloc(bytes + 2);
    CHECK(fresh_rows != NULL && cached_rows != NULL);
    mr_tensor_to_host(&f.result.recv_x, recv, fresh_rows);

    epx_dispatch_args_t cached = f.args; /* topk_idx and topk_weights still set */
    cached.handle = handle;
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    epx_status_t got = epx_dispatch(f.buffer, &cached, &result, NULL);
    if (got != EPX_SUCCESS)
        TEST_FAIL("rank %d: cached dispatch with topk_idx and topk_weights given returned %s: %s",
                  bi_info.rank, epx_status_name(got), epx_last_error());
    CHECK(result.handle == handle);
    CHECK_EQ_INT(result.num_recv_tokens, recv);
    CHECK(result.recv_topk_idx.data == NULL);     /* cached mode routes by the handle */
    CHECK(result.recv_topk_weights.data == NULL); /* and sends no weights */
    mr_tensor_to_host(&result.recv_x, recv, cached_rows);
    if (memcmp(fresh_rows, cached_rows, bytes) != 0)
        TEST_FAIL("rank %d: the cached dispatch received other rows than the fresh one",
                  bi_info.rank);
    printf("accepted cached dispatch with topk_idx and topk_weights given (ignored)\n");
    CHECK_OK(epx_handle_destroy(handle));
    free(fresh_rows);
    free(cached_rows);
    bi_teardown(&f);
}

/* The last rank alone passes fp32 x: it is refused there, the others hear of it at once. */
static void run_one_rank_wrong_dtype(void)
{
    int bad = bi_info.world_size - 1;
    char culprit[32];
    snprintf(culprit, sizeof culprit, "rank %d", bad);
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    if (bi_info.rank == bad)
        f.args.x.dtype = EPX_DTYPE_FP32;
    double start = mr_now_ms();
    epx_status_t got = epx_dispatch(f.buffer, &f.args, &f.result, NULL);
    double elapsed = mr_now_ms() - start;
    if (bi_info.rank == bad) {
        bi_expect("dispatch: fp32 x on this rank alone", got, EPX_ERR_INVALID_ARG, "x");
        epx_status_t error = EPX_SUCCESS;
        CHECK_OK(epx_get_async_error(f.buffer, &error, NULL, 0));
        if (bi_info.backend == EPX_BACKEND_HOST)
            CHECK_STATUS(error, EPX_SUCCESS); /* refused here with no effect */
    } else {
        bi_expect("dispatch: fp32 x on the last rank", got, EPX_ERR_REMOTE, culprit);
        if (elapsed > 5000)
            TEST_FAIL("rank %d: the refusal on rank %d took %.0f ms to arrive", bi_info.rank,
                      bad, elapsed);
    }
    bi_teardown(&f);
}

void bi_run_form_cases(void)
{
    run_cached_with_routing();
    if (bi_info.backend == EPX_BACKEND_HOST) {
        run_all_ranks_partial_outputs();
        run_all_ranks_wrong_size();
    }
    if (bi_info.world_size > 1)
        run_one_rank_wrong_dtype();
}
