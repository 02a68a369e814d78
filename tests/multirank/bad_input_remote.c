/*
 * Failures that cross ranks (test_bad_input with two or more ranks): the rank that gets
 * bad input sees its own error; every other rank gets EPX_ERR_REMOTE naming it, not a
 * hang; the buffer then keeps returning that first error; the group stays usable.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bad_input.h"
#include "core/core.h"
#include "epx_tool.h"
#include "mem.h"
#include "test_util.h"

/* Later calls on a failed buffer return the first error; the async error says so too. */
static void expect_poisoned(bi_fixture_t *f, epx_status_t first, const char *culprit)
{
    epx_status_t error = EPX_SUCCESS;
    char message[512];
    bi_expect("dispatch on the failed buffer", epx_dispatch(f->buffer, &f->args, &f->result, NULL),
              first, culprit);
    CHECK_OK(epx_get_async_error(f->buffer, &error, message, sizeof message));
    CHECK_STATUS(error, first);
    if (strstr(message, culprit) == NULL)
        TEST_FAIL("async error \"%s\" does not mention \"%s\"", message, culprit);
}

/* After an asynchronous operation: the peer's failure shows in the async error, then the
 * next call returns it. */
static void expect_async_remote(bi_fixture_t *f, const char *culprit)
{
    mr_mem_sync();
    expect_poisoned(f, EPX_ERR_REMOTE, culprit);
}

/* Rank `bad` passes input that `break_input` breaks; it must get `status` naming `culprit`. */
static void run_one_bad_rank(const char *what, int bad, epx_dtype_t dtype, int64_t tokens,
                             void (*break_input)(bi_fixture_t *f), epx_status_t status,
                             const char *culprit)
{
    bi_fixture_t f;
    char peer[32], text[160];
    bi_setup(&f, dtype, bi_info.rank == bad ? tokens : BI_TOKENS);
    if (bi_info.rank == bad)
        break_input(&f);
    epx_status_t got = epx_dispatch(f.buffer, &f.args, &f.result, NULL);
    snprintf(peer, sizeof peer, "rank %d", bad);
    if (bi_info.rank == bad) {
        snprintf(text, sizeof text, "%s (this rank)", what);
        bi_expect(text, got, status, culprit);
        expect_poisoned(&f, status, culprit);
    } else {
        snprintf(text, sizeof text, "%s (on %s)", what, peer);
        bi_expect(text, got, EPX_ERR_REMOTE, peer);
        expect_poisoned(&f, EPX_ERR_REMOTE, peer);
    }
    bi_teardown(&f);
}

static void expert_out_of_range(bi_fixture_t *f) { bi_set_expert(f, 1, 1, f->c.num_experts); }
/* The caller found a problem itself and aborts the buffer before the collective call. */
static void caller_aborts(bi_fixture_t *f)
{
    CHECK_OK(epx_buffer_abort(f->buffer, EPX_ERR_INVALID_ARG, "the caller refused its x"));
}
static void no_change(bi_fixture_t *f) { (void)f; }

/* A good dispatch on every rank, then rank 0 passes a wrong out_x to combine. */
static void run_bad_combine(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    int64_t num_recv = f.result.num_recv_tokens;
    void *x = mr_mem_alloc((size_t)(num_recv * BI_HIDDEN) * 2, 0);
    void *out_x = mr_mem_alloc((size_t)((BI_TOKENS + 1) * BI_HIDDEN) * 2, 0);
    epx_combine_args_t args = EPX_COMBINE_ARGS_INIT;
    args.handle = f.result.handle;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, num_recv, BI_HIDDEN);
    args.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, BI_TOKENS + (bi_info.rank == 0), BI_HIDDEN);
    epx_status_t got = epx_combine(f.buffer, &args, NULL);
    if (bi_info.rank == 0)
        bi_expect("combine: out_x rows wrong (this rank)", got, EPX_ERR_INVALID_ARG, "out_x");
    else if (got == EPX_SUCCESS && bi_info.backend == EPX_BACKEND_CUDA)
        /* The CUDA combine only enqueues work (no host sync, so it can overlap and be
         * captured in a graph): the peer's failure ends the kernel early and surfaces
         * through the async error once the stream has run, and on the next call. */
        expect_async_remote(&f, "rank 0");
    else
        bi_expect("combine: out_x rows wrong (on rank 0)", got, EPX_ERR_REMOTE, "rank 0");
    CHECK_OK(epx_handle_destroy(f.result.handle));
    mr_mem_free(x);
    mr_mem_free(out_x);
    bi_teardown(&f);
}

/* This process's EPX_* table read again with `name` set to `value` (NULL: unset). */
static void reload_params(const char *name, const char *value)
{
    if (value != NULL)
        setenv(name, value, 1);
    else
        unsetenv(name);
    epx__params_reset();
    CHECK_OK(epx_params_load());
}

/*
 * CUDA: rank 1's low-latency kernels set differently from rank 0's (EPX_LL_RELEASE, or
 * EPX_LL_KERNELS where kernels 1 are in force, which give slots back one way only): every
 * rank's epx_buffer_create refuses, naming both ranks' values, where the kernels would
 * otherwise wait for flags that never come. Then, set alike again, a buffer is made.
 */
static void run_ll_settings_differ(epx_buffer_config_t config)
{
    epx_param_info_t kernels = EPX_PARAM_INFO_INIT;
    CHECK_OK(epx_param_find("EPX_LL_KERNELS", &kernels));
    const char *name = kernels.int_value == 1 ? "EPX_LL_KERNELS" : "EPX_LL_RELEASE";
    const char *was = getenv(name);
    char saved[32] = "";
    if (was != NULL)
        snprintf(saved, sizeof(saved), "%s", was);
    epx_param_info_t now = EPX_PARAM_INFO_INIT;
    CHECK_OK(epx_param_find(name, &now));
    if (bi_info.rank == 1)
        reload_params(name, now.int_value == 1 ? "2" : "1");
    config.max_low_latency_tokens = 4;
    epx_buffer_t buffer = NULL;
    bi_expect("buffer_create: rank 1's low-latency kernel settings differ",
              epx_buffer_create(bi_group, &config, &buffer), EPX_ERR_INVALID_ARG,
              "low-latency settings differ");
    CHECK_ERROR_MENTIONS(name);
    CHECK(buffer == NULL);
    if (bi_info.rank == 1)
        reload_params(name, was != NULL ? saved : NULL);
    CHECK_OK(epx_buffer_create(bi_group, &config, &buffer));
    CHECK_OK(epx_buffer_destroy(buffer));
}

/* Buffer creation: a config every rank rejects, and configs that differ between ranks. */
static void run_bad_configs(void)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    epx_buffer_t buffer = NULL;
    config.max_tokens_per_rank = BI_MAX_TOKENS;
    config.hidden = BI_HIDDEN;
    config.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size + 1;
    config.num_topk = BI_TOPK;
    bi_expect("buffer_create: num_experts not a multiple of the world size",
              epx_buffer_create(bi_group, &config, &buffer), EPX_ERR_INVALID_ARG,
              "num_experts");
    CHECK(buffer == NULL);

    config.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size;
    config.hidden = bi_info.rank == 1 ? 2 * BI_HIDDEN : BI_HIDDEN;
    epx_status_t got = epx_buffer_create(bi_group, &config, &buffer);
    const char *peer = bi_info.rank == 1 ? "rank 0" : "rank 1";
    if (got != EPX_ERR_INVALID_ARG && got != EPX_ERR_REMOTE)
        TEST_FAIL("buffer_create with rank 1's hidden different returned %s (last error: %s)",
                  epx_status_name(got), epx_last_error());
    bi_expect("buffer_create: rank 1's config differs", got, got, peer);
    CHECK(buffer == NULL);

    /* Low-latency rows sized differently on one rank would misplace every peer's writes. */
    config.hidden = BI_HIDDEN;
    config.max_low_latency_tokens = 4;
    config.low_latency_dtype = bi_info.rank == 1 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    got = epx_buffer_create(bi_group, &config, &buffer);
    if (got != EPX_ERR_INVALID_ARG && got != EPX_ERR_REMOTE)
        TEST_FAIL("buffer_create with rank 1's low_latency_dtype different returned %s (last "
                  "error: %s)",
                  epx_status_name(got), epx_last_error());
    bi_expect("buffer_create: rank 1's low_latency_dtype differs", got, got, peer);
    CHECK(buffer == NULL);
    if (bi_info.backend == EPX_BACKEND_CUDA) {
        config.low_latency_dtype = EPX_DTYPE_BF16;
        run_ll_settings_differ(config);
    }

    /* Combine's exchange for inputs mapped on demand runs only if every rank runs it. */
    config.max_low_latency_tokens = 0;
    config.low_latency_dtype = EPX_DTYPE_BF16;
    config.auto_register = bi_info.rank == 1 ? 1 : -1;
    got = epx_buffer_create(bi_group, &config, &buffer);
    if (got != EPX_ERR_INVALID_ARG && got != EPX_ERR_REMOTE)
        TEST_FAIL("buffer_create with rank 1's auto_register different returned %s (last "
                  "error: %s)",
                  epx_status_name(got), epx_last_error());
    bi_expect("buffer_create: rank 1's auto_register differs", got, got,
              bi_info.rank == 1 ? "auto_register off" : "auto_register on");
    CHECK(buffer == NULL);
    config.auto_register = 2;
    bi_expect("buffer_create: auto_register 2", epx_buffer_create(bi_group, &config, &buffer),
              EPX_ERR_INVALID_ARG, "config.auto_register is 2");
    CHECK(buffer == NULL);
    /* A config from before the field was appended ignores whatever lies there. */
    config.size = offsetof(epx_buffer_config_t, auto_register);
    size_t bytes = 0;
    CHECK_OK(epx_buffer_size(bi_group, &config, &bytes));
    CHECK(bytes > 0);
}

/* epx_buffer_abort on one rank (any world size): refusals first, then the abort. */
void bi_run_abort_cases(void)
{
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    bi_expect("buffer_abort: NULL buffer", epx_buffer_abort(NULL, EPX_ERR_INVALID_ARG, "x"),
              EPX_ERR_INVALID_ARG, "buffer");
    bi_expect("buffer_abort: EPX_SUCCESS", epx_buffer_abort(f.buffer, EPX_SUCCESS, "x"),
              EPX_ERR_INVALID_ARG, "status");
    bi_expect("buffer_abort: status 999", epx_buffer_abort(f.buffer, (epx_status_t)999, "x"),
              EPX_ERR_INVALID_ARG, "status");
    /* Refused aborts changed nothing: the buffer still works. */
    epx_status_t error = EPX_SUCCESS;
    CHECK_OK(epx_get_async_error(f.buffer, &error, NULL, 0));
    CHECK_STATUS(error, EPX_SUCCESS);
    if (bi_info.world_size == 1) {
        CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
        CHECK_OK(epx_handle_destroy(f.result.handle));
        f.result = (epx_dispatch_result_t)EPX_DISPATCH_RESULT_INIT;
        /* A NULL message gets a default text; later calls return the abort's status. */
        CHECK_OK(epx_buffer_abort(f.buffer, EPX_ERR_TIMEOUT, NULL));
        expect_poisoned(&f, EPX_ERR_TIMEOUT, "aborted");
    }
    bi_teardown(&f);
}

void bi_run_remote_cases(void)
{
    run_one_bad_rank("dispatch: rank 1 expert id out of range", 1, EPX_DTYPE_BF16, BI_TOKENS,
                     expert_out_of_range, EPX_ERR_INVALID_ARG, "topk_idx");
    run_one_bad_rank("dispatch: rank 1 over max_tokens", 1, EPX_DTYPE_FP8_E4M3,
                     BI_MAX_TOKENS + 3, no_change, EPX_ERR_CAPACITY, "max_tokens_per_rank");
    run_one_bad_rank("dispatch: rank 1 aborted the buffer first", 1, EPX_DTYPE_BF16, BI_TOKENS,
                     caller_aborts, EPX_ERR_INVALID_ARG, "refused");
    run_bad_combine();
    run_bad_configs();
    bi_run_ll_alignment_cases();

    /* After all that, a fresh buffer works on every rank. */
    bi_fixture_t f;
    bi_setup(&f, EPX_DTYPE_BF16, BI_TOKENS);
    CHECK_OK(epx_dispatch(f.buffer, &f.args, &f.result, NULL));
    CHECK(f.result.num_recv_tokens >= 0);
    CHECK_OK(epx_handle_destroy(f.result.handle));
    bi_teardown(&f);
}
