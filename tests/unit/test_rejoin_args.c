/*
 * The arguments of epx_ll_rejoin and epx_buffer_create_rejoin (include/epx.h), with
 * groups of one rank: every bad input is refused with its error and a message, and the
 * buffer goes on serving afterwards. The collective refusals (a rank not masked, configs
 * that differ, rank numbers swapped, a live rank masked, an old process still running)
 * need several ranks: tests/multirank/test_ll_rejoin.c.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "epx.h"
#include "test_util.h"

#define TOKENS 4
#define HIDDEN 64
#define EXPERTS 4
#define TOPK 2

static uint16_t x[TOKENS * HIDDEN];
static int64_t idx[TOKENS * TOPK];
static float weights[TOKENS * TOPK];
static uint16_t out[TOKENS * HIDDEN];

static epx_group_t group_of_one(void)
{
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.backend = EPX_BACKEND_HOST;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    return group;
}

static epx_buffer_config_t config_with(int64_t low_latency_tokens)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = TOKENS;
    config.hidden = HIDDEN;
    config.num_experts = EXPERTS;
    config.num_topk = TOPK;
    config.max_low_latency_tokens = low_latency_tokens;
    return config;
}

/* One low-latency step; `flags` EPX_LL_SEND_ONLY leaves the dispatch in flight. */
static epx_status_t dispatch(epx_buffer_t buffer, uint32_t flags, epx_ll_dispatch_result_t *got)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, TOKENS, TOPK);
    args.flags = flags;
    *got = (epx_ll_dispatch_result_t)EPX_LL_DISPATCH_RESULT_INIT;
    return epx_ll_dispatch(buffer, &args, got, NULL);
}

/* The buffer still serves: a whole step whose combine returns each token's weighted x. */
static void check_serves(epx_buffer_t buffer)
{
    epx_ll_dispatch_result_t got;
    CHECK_OK(dispatch(buffer, 0, &got));
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = got.handle;
    CHECK_OK(epx_ll_get_combine_buffer(buffer, got.handle, &args.x));
    /* The experts return their rows unchanged: recv_x is bf16 with the combine's layout. */
    memcpy(args.x.data, got.recv_x.data,
           (size_t)(EXPERTS * TOKENS * HIDDEN) * sizeof(uint16_t));
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, TOKENS, TOPK);
    args.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, TOKENS, TOPK);
    args.out = epx_tensor_2d(out, EPX_DTYPE_BF16, TOKENS, HIDDEN);
    memset(out, 0xff, sizeof out);
    CHECK_OK(epx_ll_combine(buffer, &args, NULL, NULL));
    CHECK(memcmp(out, x, sizeof out) == 0); /* weight 1 on one expert: x itself */
}

int main(void)
{
    for (int i = 0; i < TOKENS * HIDDEN; i++)
        x[i] = (uint16_t)(0x3f80 + (i % 64)); /* 1.0 .. 1.49, exact through fp32 */
    for (int t = 0; t < TOKENS; t++) {
        idx[t * TOPK] = t % EXPERTS;
        idx[t * TOPK + 1] = -1;
        weights[t * TOPK] = 1.0f;
        weights[t * TOPK + 1] = 0.5f;
    }
    epx_group_t first = group_of_one(), second = group_of_one();
    epx_buffer_config_t config = config_with(TOKENS);
    epx_buffer_t buffer = NULL, normal_only = NULL, made = NULL;
    CHECK_OK(epx_buffer_create(first, &config, &buffer));
    epx_buffer_config_t no_ll = config_with(0);
    CHECK_OK(epx_buffer_create(first, &no_ll, &normal_only));

    /* Survivor side. */
    CHECK_STATUS(epx_ll_rejoin(buffer, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("group");
    CHECK_STATUS(epx_ll_rejoin(buffer, first), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("own group");
    CHECK_STATUS(epx_ll_rejoin(NULL, second), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("buffer");
    CHECK_STATUS(epx_ll_rejoin(normal_only, second), EPX_ERR_INVALID_STATE);
    CHECK_ERROR_MENTIONS("low-latency");
    epx_ll_dispatch_result_t pending;
    CHECK_OK(dispatch(buffer, EPX_LL_SEND_ONLY, &pending));
    CHECK_STATUS(epx_ll_rejoin(buffer, second), EPX_ERR_INVALID_STATE);
    CHECK_ERROR_MENTIONS("in flight");
    CHECK_OK(epx_ll_receive(buffer, pending.handle, NULL));
    /* Nobody masked and nobody new: nothing to do. */
    CHECK_STATUS(epx_ll_rejoin(buffer, second), EPX_ERR_INVALID_STATE);
    CHECK_ERROR_MENTIONS("nobody to take back");
    check_serves(buffer); /* every refusal left the buffer as it was */

    /* Newcomer side. */
    CHECK_STATUS(epx_buffer_create_rejoin(NULL, &config, &made), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_buffer_create_rejoin(second, NULL, &made), EPX_ERR_INVALID_ARG);
    epx_buffer_config_t bad_size = config;
    bad_size.size = 3;
    CHECK_STATUS(epx_buffer_create_rejoin(second, &bad_size, &made), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("size");
    CHECK_STATUS(epx_buffer_create_rejoin(second, &config, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("buffer is NULL");
    CHECK_STATUS(epx_buffer_create_rejoin(second, &no_ll, &made), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("max_low_latency_tokens");
    /* Every rank of the group is new: there is no running buffer to join. */
    CHECK_STATUS(epx_buffer_create_rejoin(second, &config, &made), EPX_ERR_INVALID_STATE);
    CHECK_ERROR_MENTIONS("no running buffer");
    CHECK(made == NULL); /* written on success only */

    /* A buffer that failed cannot take anyone back. */
    CHECK_OK(epx_buffer_abort(buffer, EPX_ERR_INTERNAL, "the test failed it"));
    CHECK_STATUS(epx_ll_rejoin(buffer, second), EPX_ERR_INTERNAL);
    CHECK_ERROR_MENTIONS("failed earlier");
    /* Nor can a destroyed one. */
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_STATUS(epx_ll_rejoin(buffer, second), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("not a live");
    CHECK_OK(epx_buffer_destroy(normal_only));
    CHECK_OK(epx_group_destroy(second));
    /* A destroyed group: refused at once. */
    CHECK_STATUS(epx_buffer_create_rejoin(second, &config, &made), EPX_ERR_INVALID_ARG);
    CHECK_OK(epx_group_destroy(first));
    printf("test_rejoin_args: ok\n");
    return 0;
}
