/*
 * Every rejected input returns its status with a message that names the culprit.
 *
 *   epx launch -n 1 -- test_bad_input [--backend host|cuda|auto]   (local checks)
 *   epx launch -n 2 -- test_bad_input [--backend ...]              (failures across ranks)
 *
 * A rejected input inside a collective call poisons the buffer (include/epx.h), so each
 * case gets a fresh buffer. With one rank the program runs the argument checks of every
 * entry point; with two it checks that a failure on one rank reaches the other as
 * EPX_ERR_REMOTE naming the failed rank, and that both then exit cleanly.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bad_input.h"
#include "harness.h"
#include "mem.h"
#include "test_util.h"

epx_group_t bi_group;
epx_group_info_t bi_info = EPX_GROUP_INFO_INIT;

/* Is `word` in `text` with no identifier character on either side? */
static int mentions_word(const char *text, const char *word)
{
    size_t length = strlen(word);
    for (const char *at = strstr(text, word); at != NULL; at = strstr(at + 1, word)) {
        char before = at == text ? ' ' : at[-1];
        char after = at[length];
        int before_ok = !(before == '_' || (before >= 'a' && before <= 'z') ||
                          (before >= 'A' && before <= 'Z') || (before >= '0' && before <= '9'));
        int after_ok = !(after == '_' || (after >= 'a' && after <= 'z') ||
                         (after >= 'A' && after <= 'Z') || (after >= '0' && after <= '9'));
        if (before_ok && after_ok)
            return 1;
    }
    return 0;
}

void bi_expect(const char *what, epx_status_t got, epx_status_t want, const char *culprit)
{
    if (got != want)
        TEST_FAIL("%s: returned %s, expected %s (last error: \"%s\")", what,
                  epx_status_name(got), epx_status_name(want), epx_last_error());
    CHECK_ERROR_MENTIONS(culprit);
    if (!mentions_word(epx_last_error(), culprit))
        TEST_FAIL("%s: last error \"%s\" mentions \"%s\" only inside another word", what,
                  epx_last_error(), culprit);
    printf("rejected %-44s %-20s \"%s\"\n", what, epx_status_name(got), epx_last_error());
}

void bi_expect_async(epx_buffer_t buffer, const char *what, const char *names)
{
    mr_mem_sync();
    epx_status_t async = EPX_SUCCESS;
    char text[256];
    CHECK_OK(epx_get_async_error(buffer, &async, text, sizeof text));
    CHECK_EQ_INT(async, EPX_ERR_INVALID_ARG);
    if (strstr(text, names) == NULL)
        TEST_FAIL("%s: async error \"%s\" does not name %s", what, text, names);
    printf("rejected %-44s %-20s \"%s\"\n", what, epx_status_name(async), text);
}

/* ---------------------------------------------------------------- fixture */

void bi_setup(bi_fixture_t *f, epx_dtype_t dtype, int64_t tokens)
{
    memset(f, 0, sizeof *f);
    f->c.world_size = bi_info.world_size;
    f->c.num_tokens = tokens;
    f->c.hidden = BI_HIDDEN;
    f->c.num_experts = BI_EXPERTS_PER_RANK * bi_info.world_size;
    f->c.num_topk = BI_TOPK;
    f->c.dtype = dtype;
    f->c.expert_alignment = 1;
    f->c.seed = 42;
    f->c.routing = MOE_ROUTING_RANDOM;
    f->c.empty_rank = -1;
    CHECK_EQ_INT(moe_inputs_make(&f->c, bi_info.rank, &f->host), 0);

    int fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    int64_t scale_cols = BI_HIDDEN / 128;
    f->x = mr_mem_from_host(f->host.x, (size_t)(tokens * BI_HIDDEN) * epx_dtype_size(dtype));
    f->scales = fp8 ? mr_mem_from_host(f->host.x_scales, (size_t)(tokens * scale_cols) * 4)
                    : mr_mem_alloc(64, 0);
    f->idx = mr_mem_from_host(f->host.topk_idx, (size_t)(tokens * BI_TOPK) * 8);
    f->weights = mr_mem_from_host(f->host.topk_weights, (size_t)(tokens * BI_TOPK) * 4);

    f->config = (epx_buffer_config_t)EPX_BUFFER_CONFIG_INIT;
    f->config.max_tokens_per_rank = BI_MAX_TOKENS;
    f->config.hidden = BI_HIDDEN;
    f->config.num_experts = f->c.num_experts;
    f->config.num_topk = BI_TOPK;
    f->config.dispatch_dtype = dtype;
    CHECK_OK(epx_buffer_create(bi_group, &f->config, &f->buffer));

    f->args = (epx_dispatch_args_t)EPX_DISPATCH_ARGS_INIT;
    f->args.x = epx_tensor_2d(f->x, dtype, tokens, BI_HIDDEN);
    if (fp8)
        f->args.x_scales = epx_tensor_2d(f->scales, EPX_DTYPE_FP32, tokens, scale_cols);
    f->args.topk_idx = epx_tensor_2d(f->idx, EPX_DTYPE_INT64, tokens, BI_TOPK);
    f->args.topk_weights = epx_tensor_2d(f->weights, EPX_DTYPE_FP32, tokens, BI_TOPK);
    f->result = (epx_dispatch_result_t)EPX_DISPATCH_RESULT_INIT;
}

void bi_set_expert(bi_fixture_t *f, int64_t token, int j, int64_t expert)
{
    f->host.topk_idx[token * BI_TOPK + j] = expert;
    mr_mem_to_device(f->idx, f->host.topk_idx, (size_t)(f->host.num_tokens * BI_TOPK) * 8);
}

void bi_teardown(bi_fixture_t *f)
{
    CHECK_OK(epx_buffer_destroy(f->buffer));
    mr_mem_free(f->x);
    mr_mem_free(f->scales);
    mr_mem_free(f->idx);
    mr_mem_free(f->weights);
    for (int i = 0; i < 4; i++)
        if (f->outputs[i] != NULL)
            mr_mem_free(f->outputs[i]);
    moe_inputs_free(&f->host);
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    /* A hang is a failure too: the alarm ends the program well inside the test timeout. */
    alarm(100);
    bi_group = mr_group_create(argc, argv, &bi_info);
    const char *mode = mr_flag(argc, argv, "--mode", bi_info.world_size == 1 ? "local" : "remote");
    if (strcmp(mode, "local") == 0) {
        bi_run_config_cases();
        bi_run_dispatch_cases();
        bi_run_combine_cases();
        bi_run_layout_cases();
        bi_run_ll_cases();
        bi_run_abort_cases();
        bi_run_form_cases();
        bi_run_fanout_cases();
        bi_run_fanin_cases();
        bi_run_register_cases();
    } else if (strcmp(mode, "remote") == 0) {
        if (bi_info.world_size < 2)
            TEST_FAIL("--mode remote needs at least 2 ranks");
        bi_run_fanout_cases();
        bi_run_fanin_cases();
        bi_run_remote_cases();
        bi_run_form_cases();
        bi_run_register_remote_cases();
    } else {
        TEST_FAIL("--mode %s: expected local or remote", mode);
    }
    /* The group outlives the poisoned buffers. */
    CHECK_OK(epx_group_barrier(bi_group));
    CHECK_OK(epx_group_destroy(bi_group));
    printf("test_bad_input: %s mode ok (rank %d of %d)\n", mode, bi_info.rank,
           bi_info.world_size);
    return 0;
}
