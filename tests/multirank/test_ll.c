/*
 * Low-latency mode against the oracle (tests/common/moe_ll.h), on every rank:
 *
 *   epx launch -n N -- test_ll [--backend host|cuda|auto]
 *
 * Cases: bf16; fp8 with fp32 scales, power-of-two scales, and packed ue8m0; -1 entries
 * and a duplicated expert; an empty rank; EPX_LL_SEND_ONLY with receive; two steps in
 * flight with step 0's combine after step 1's dispatch, through the zero-copy combine
 * buffer; every misuse error (which must leave the buffer usable); a masked rank (with
 * two or more ranks). Values are compared exactly (same algorithm, same rounding).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "moe_ll.h"
#include "test_util.h"

static epx_group_t group;
static epx_group_info_t info;

#define MAX_TOKENS 8
#define EXPERTS_PER_RANK 5
#define TOPK 4

typedef struct {
    moe_case_t c;
    moe_ll_cast_t cast;
    moe_inputs_t in;
    epx_ll_dispatch_result_t got;
    uint16_t *out;
} step_t;

static epx_buffer_t make_buffer(int64_t hidden)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = MAX_TOKENS;
    config.hidden = hidden;
    config.num_experts = EXPERTS_PER_RANK * info.world_size;
    config.num_topk = TOPK;
    config.max_low_latency_tokens = MAX_TOKENS;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    return buffer;
}

static void step_init(step_t *s, uint64_t seed, int64_t hidden, int64_t tokens, int empty_rank,
                      moe_ll_cast_t cast)
{
    memset(s, 0, sizeof(*s));
    s->c.world_size = info.world_size;
    s->c.num_tokens = tokens;
    s->c.hidden = hidden;
    s->c.num_experts = EXPERTS_PER_RANK * info.world_size;
    s->c.num_topk = TOPK;
    s->c.dtype = EPX_DTYPE_BF16;
    s->c.expert_alignment = 1;
    s->c.seed = seed;
    s->c.routing = MOE_ROUTING_RANDOM;
    s->c.drop_fraction = 0.2;
    s->c.empty_rank = empty_rank;
    s->cast = cast;
    CHECK_EQ_INT(moe_ll_inputs_make(&s->c, info.rank, &s->in), 0);
    s->out = calloc((size_t)(s->in.num_tokens * hidden) + 1, 2);
    CHECK(s->out != NULL);
}

static void step_free(step_t *s)
{
    moe_inputs_free(&s->in);
    free(s->out);
}

static epx_status_t step_dispatch(epx_buffer_t buffer, step_t *s, uint32_t flags)
{
    epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
    args.x = epx_tensor_2d(s->in.x, EPX_DTYPE_BF16, s->in.num_tokens, s->c.hidden);
    args.topk_idx = epx_tensor_2d(s->in.topk_idx, EPX_DTYPE_INT64, s->in.num_tokens, TOPK);
    args.use_fp8 = s->cast.use_fp8;
    args.round_scale = s->cast.round_scale;
    args.use_ue8m0 = s->cast.use_ue8m0;
    args.flags = flags;
    s->got = (epx_ll_dispatch_result_t)EPX_LL_DISPATCH_RESULT_INIT;
    return epx_ll_dispatch(buffer, &args, &s->got, NULL);
}

static void check_dispatch(const step_t *s, const uint8_t *mask)
{
    moe_ll_expected_t e;
    CHECK_EQ_INT(moe_ll_oracle_dispatch(&s->c, info.rank, MAX_TOKENS, mask, s->cast, &e), 0);
    const epx_ll_dispatch_result_t *g = &s->got;
    int64_t hidden = s->c.hidden, rows = e.rows, world = info.world_size;
    CHECK_EQ_INT(g->recv_x.ndim, 3);
    CHECK_EQ_INT(g->recv_x.shape[0], e.num_local);
    CHECK_EQ_INT(g->recv_x.shape[1], rows);
    CHECK_EQ_INT(g->recv_x.dtype, s->cast.use_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16);
    CHECK_EQ_INT(g->num_masked_entries, e.masked_entries);
    const int32_t *count = g->recv_count.data;
    const int32_t *src = g->recv_src_info.data;
    const int64_t *range = g->recv_layout_range.data;
    size_t element = s->cast.use_fp8 ? 1 : 2;
    int64_t groups = hidden / 128;
    for (int local = 0; local < e.num_local; local++) {
        CHECK_EQ_INT(count[local], e.count[local]);
        for (int r = 0; r < world; r++)
            CHECK_EQ_INT(range[local * world + r], e.range[local * world + r]);
        for (int64_t i = 0; i < e.count[local]; i++) {
            int64_t row = local * rows + i;
            CHECK_EQ_INT(src[row], e.src_token[row]);
            if (memcmp((const char *)g->recv_x.data + (size_t)row * hidden * element,
                       (const char *)e.x + (size_t)row * hidden * element,
                       (size_t)hidden * element) != 0)
                TEST_FAIL("rank %d expert %d row %lld: x differs from the oracle", info.rank,
                          local, (long long)i);
            if (!s->cast.use_fp8)
                continue;
            for (int64_t gi = 0; gi < groups; gi++) {
                float want = e.scales[row * groups + gi];
                if (s->cast.use_ue8m0) {
                    const uint8_t *bytes = (const uint8_t *)g->recv_x_scales.data;
                    uint32_t bits;
                    memcpy(&bits, &want, 4);
                    CHECK_EQ_INT(bytes[(size_t)row * groups + (size_t)gi], (bits >> 23) & 0xff);
                } else {
                    float have = ((const float *)g->recv_x_scales.data)[row * groups + gi];
                    CHECK(memcmp(&have, &want, 4) == 0);
                }
            }
        }
    }
    moe_ll_expected_free(&e);
}

/* Expert outputs of this rank's received rows into x [L][rows][hidden]. */
static void fill_expert_outputs(const step_t *s, uint16_t *x)
{
    int world = info.world_size, num_local = EXPERTS_PER_RANK;
    int64_t rows = (int64_t)MAX_TOKENS * world, hidden = s->c.hidden;
    const int32_t *count = s->got.recv_count.data;
    const int32_t *src = s->got.recv_src_info.data;
    const int64_t *range = s->got.recv_layout_range.data;
    for (int local = 0; local < num_local; local++) {
        for (int r = 0; r < world; r++) {
            int64_t begin = (int64_t)((uint64_t)range[local * world + r] >> 32);
            int64_t n = range[local * world + r] & 0xffffffff;
            for (int64_t i = begin; i < begin + n; i++)
                moe_ll_expert_row(&s->c, (int64_t)info.rank * num_local + local, r,
                                  src[local * rows + i], x + ((size_t)local * rows + i) * hidden);
        }
        CHECK(count[local] <= rows);
    }
}

static epx_status_t step_combine(epx_buffer_t buffer, step_t *s, void *x, uint32_t flags,
                                 epx_ll_combine_result_t *result)
{
    epx_ll_combine_args_t args = EPX_LL_COMBINE_ARGS_INIT;
    args.handle = s->got.handle;
    args.x = (epx_tensor_t)EPX_TENSOR_NONE;
    args.x.data = x;
    args.x.dtype = EPX_DTYPE_BF16;
    args.x.ndim = 3;
    args.x.shape[0] = EXPERTS_PER_RANK;
    args.x.shape[1] = (int64_t)MAX_TOKENS * info.world_size;
    args.x.shape[2] = s->c.hidden;
    args.topk_idx = epx_tensor_2d(s->in.topk_idx, EPX_DTYPE_INT64, s->in.num_tokens, TOPK);
    args.topk_weights = epx_tensor_2d(s->in.topk_weights, EPX_DTYPE_FP32, s->in.num_tokens, TOPK);
    args.out = epx_tensor_2d(s->out, EPX_DTYPE_BF16, s->in.num_tokens, s->c.hidden);
    args.flags = flags;
    return epx_ll_combine(buffer, &args, result, NULL);
}

static void check_combine(const step_t *s, const uint8_t *mask, int64_t masked_reported)
{
    uint16_t *want;
    int64_t masked;
    CHECK_EQ_INT(moe_ll_oracle_combine(&s->c, info.rank, mask, &want, &masked), 0);
    if (masked_reported >= 0)
        CHECK_EQ_INT(masked_reported, masked);
    int64_t n = s->in.num_tokens * s->c.hidden;
    for (int64_t i = 0; i < n; i++)
        if (s->out[i] != want[i])
            TEST_FAIL("rank %d combine element %lld: 0x%04x, oracle 0x%04x", info.rank,
                      (long long)i, s->out[i], want[i]);
    free(want);
}

static uint16_t *alloc_combine_input(int64_t hidden)
{
    size_t cells = (size_t)EXPERTS_PER_RANK * MAX_TOKENS * (size_t)info.world_size * (size_t)hidden;
    uint16_t *x = calloc(cells, 2);
    CHECK(x != NULL);
    return x;
}

/* One blocking step: dispatch, check, combine, check. */
static void run_blocking(const char *name, int64_t hidden, moe_ll_cast_t cast, int empty_rank)
{
    epx_buffer_t buffer = make_buffer(hidden);
    for (int iteration = 0; iteration < 3; iteration++) {
        step_t s;
        step_init(&s, 100 + (uint64_t)iteration, hidden, MAX_TOKENS - iteration, empty_rank, cast);
        CHECK_OK(step_dispatch(buffer, &s, 0));
        check_dispatch(&s, NULL);
        uint16_t *x = alloc_combine_input(hidden);
        fill_expert_outputs(&s, x);
        epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
        CHECK_OK(step_combine(buffer, &s, x, 0, &result));
        check_combine(&s, NULL, result.num_masked_entries);
        free(x);
        step_free(&s);
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: %s ok\n", name);
}

/* Two steps in flight; step 0's combine after step 1's dispatch; zero-copy combine. */
static void run_overlap(void)
{
    int64_t hidden = 256;
    moe_ll_cast_t fp8 = {1, 0, 0}, bf16 = {0, 0, 0};
    epx_buffer_t buffer = make_buffer(hidden);
    for (int round = 0; round < 3; round++) {
        step_t s0, s1;
        step_init(&s0, 200 + (uint64_t)round * 2, hidden, MAX_TOKENS, -1, fp8);
        step_init(&s1, 201 + (uint64_t)round * 2, hidden, MAX_TOKENS - 1, -1, bf16);
        CHECK_OK(step_dispatch(buffer, &s0, EPX_LL_SEND_ONLY));
        CHECK_OK(step_dispatch(buffer, &s1, EPX_LL_SEND_ONLY));
        CHECK_OK(epx_ll_receive(buffer, s1.got.handle, NULL)); /* any order */
        CHECK_OK(epx_ll_receive(buffer, s0.got.handle, NULL));
        check_dispatch(&s0, NULL);
        check_dispatch(&s1, NULL);

        epx_tensor_t zero_copy;
        CHECK_OK(epx_ll_get_combine_buffer(buffer, s0.got.handle, &zero_copy));
        CHECK_EQ_INT(zero_copy.ndim, 3);
        CHECK_EQ_INT(zero_copy.dtype, EPX_DTYPE_BF16);
        fill_expert_outputs(&s0, zero_copy.data);
        CHECK_OK(step_combine(buffer, &s0, zero_copy.data, EPX_LL_SEND_ONLY, NULL));
        uint16_t *x1 = alloc_combine_input(hidden);
        fill_expert_outputs(&s1, x1);
        epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
        CHECK_OK(step_combine(buffer, &s1, x1, 0, &result));
        CHECK_OK(epx_ll_receive(buffer, s0.got.handle, NULL));
        check_combine(&s0, NULL, -1);
        check_combine(&s1, NULL, result.num_masked_entries);
        /* Combining a step again is allowed and gives the same answer. */
        memset(s1.out, 0, (size_t)(s1.in.num_tokens * hidden) * 2);
        CHECK_OK(step_combine(buffer, &s1, x1, 0, NULL));
        check_combine(&s1, NULL, -1);
        free(x1);
        step_free(&s0);
        step_free(&s1);
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: overlap + send-only + zero-copy ok\n");
}

static void expect_state_error(const char *what, epx_status_t got, const char *needle)
{
    if (got != EPX_ERR_INVALID_STATE)
        TEST_FAIL("%s returned %s, expected EPX_ERR_INVALID_STATE (%s)", what,
                  epx_status_name(got), epx_last_error());
    CHECK_ERROR_MENTIONS(needle);
    if (info.rank == 0)
        printf("test_ll: refused %-36s \"%s\"\n", what, epx_last_error());
}

/* Every misuse is refused with no effect; the buffer keeps working afterwards. */
static void run_misuse(void)
{
    int64_t hidden = 128;
    moe_ll_cast_t bf16 = {0, 0, 0};
    epx_buffer_t buffer = make_buffer(hidden);
    step_t s0, s1, s2;
    step_init(&s0, 300, hidden, MAX_TOKENS, -1, bf16);
    step_init(&s1, 301, hidden, MAX_TOKENS, -1, bf16);
    step_init(&s2, 302, hidden, MAX_TOKENS, -1, bf16);
    uint16_t *x = alloc_combine_input(hidden);

    CHECK_OK(step_dispatch(buffer, &s0, EPX_LL_SEND_ONLY));
    expect_state_error("combine before receive", step_combine(buffer, &s0, x, 0, NULL),
                       "epx_ll_receive");
    CHECK_OK(step_dispatch(buffer, &s1, EPX_LL_SEND_ONLY));
    expect_state_error("third operation in flight", step_dispatch(buffer, &s2, 0), "in flight");
    expect_state_error("clean while in flight", epx_ll_clean_buffer(buffer, NULL), "receive");
    CHECK_OK(epx_ll_receive(buffer, s0.got.handle, NULL));
    expect_state_error("receive with nothing pending", epx_ll_receive(buffer, s0.got.handle, NULL),
                       "nothing is pending");
    CHECK_OK(epx_ll_receive(buffer, s1.got.handle, NULL));
    check_dispatch(&s0, NULL);
    check_dispatch(&s1, NULL);
    /* Step 2 takes step 0's slot: step 0's handle is stale from now on. */
    CHECK_OK(step_dispatch(buffer, &s2, 0));
    check_dispatch(&s2, NULL);
    expect_state_error("combine with a reused slot", step_combine(buffer, &s0, x, 0, NULL),
                       "stale");
    expect_state_error("receive with a reused slot", epx_ll_receive(buffer, s0.got.handle, NULL),
                       "stale");
    epx_tensor_t view;
    expect_state_error("combine buffer of a reused slot",
                       epx_ll_get_combine_buffer(buffer, s0.got.handle, &view), "stale");
    /* Still usable: steps 1 and 2 combine correctly. */
    fill_expert_outputs(&s1, x);
    CHECK_OK(step_combine(buffer, &s1, x, EPX_LL_SEND_ONLY, NULL));
    expect_state_error("combine while its combine is pending",
                       step_combine(buffer, &s1, x, 0, NULL), "epx_ll_receive");
    CHECK_OK(epx_ll_receive(buffer, s1.got.handle, NULL));
    check_combine(&s1, NULL, -1);
    fill_expert_outputs(&s2, x);
    CHECK_OK(step_combine(buffer, &s2, x, 0, NULL));
    check_combine(&s2, NULL, -1);
    CHECK_OK(epx_ll_clean_buffer(buffer, NULL));
    expect_state_error("handle after clean", step_combine(buffer, &s2, x, 0, NULL), "stale");
    epx_ll_handle_t none = EPX_LL_HANDLE_NONE;
    CHECK_STATUS(epx_ll_receive(buffer, none, NULL), EPX_ERR_INVALID_ARG);
    /* And a fresh step after all that. */
    step_t s3;
    step_init(&s3, 303, hidden, MAX_TOKENS, -1, bf16);
    CHECK_OK(step_dispatch(buffer, &s3, 0));
    check_dispatch(&s3, NULL);
    fill_expert_outputs(&s3, x);
    CHECK_OK(step_combine(buffer, &s3, x, 0, NULL));
    check_combine(&s3, NULL, -1);
    free(x);
    step_free(&s0);
    step_free(&s1);
    step_free(&s2);
    step_free(&s3);
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: misuse ok\n");
}

/* The last rank is lost: every other rank masks it and carries on. */
static void run_masked(void)
{
    int world = info.world_size, lost = world - 1;
    int64_t hidden = 256;
    moe_ll_cast_t fp8 = {1, 1, 0};
    epx_buffer_t buffer = make_buffer(hidden);
    uint8_t *mask = calloc((size_t)world, 1);
    mask[lost] = 1;
    if (info.rank != lost) {
        CHECK_OK(epx_ll_mask_rank(buffer, lost));
        CHECK_STATUS(epx_ll_mask_rank(buffer, info.rank), EPX_ERR_INVALID_ARG);
        int32_t got_mask[64];
        CHECK_OK(epx_ll_get_masked(buffer, got_mask, 64));
        for (int r = 0; r < world; r++)
            CHECK_EQ_INT(got_mask[r], r == lost);
        for (int iteration = 0; iteration < 2; iteration++) {
            step_t s;
            step_init(&s, 400 + (uint64_t)iteration, hidden, MAX_TOKENS, -1, fp8);
            CHECK_OK(step_dispatch(buffer, &s, iteration ? EPX_LL_SEND_ONLY : 0));
            if (iteration)
                CHECK_OK(epx_ll_receive(buffer, s.got.handle, NULL));
            check_dispatch(&s, mask);
            uint16_t *x = alloc_combine_input(hidden);
            fill_expert_outputs(&s, x);
            epx_ll_combine_result_t result = EPX_LL_COMBINE_RESULT_INIT;
            CHECK_OK(step_combine(buffer, &s, x, 0, &result));
            CHECK(result.num_masked_entries > 0 || s.in.num_tokens == 0 || world > 4);
            check_combine(&s, mask, result.num_masked_entries);
            free(x);
            step_free(&s);
        }
    }
    CHECK_OK(epx_group_barrier(group));
    free(mask);
    CHECK_OK(epx_buffer_destroy(buffer));
    if (info.rank == 0)
        printf("test_ll: masked rank %d ok\n", lost);
}

int main(int argc, char **argv)
{
    alarm(100);
    group = mr_group_create(argc, argv, &info);
    if (info.backend != EPX_BACKEND_HOST) {
        /* The GPU kernels are not written yet: the API must say so, not misbehave. */
        epx_buffer_t buffer = make_buffer(128);
        epx_ll_dispatch_args_t args = EPX_LL_DISPATCH_ARGS_INIT;
        int64_t idx[TOPK] = {0, -1, -1, -1};
        uint16_t row[128] = {0};
        args.x = epx_tensor_2d(row, EPX_DTYPE_BF16, 1, 128);
        args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, 1, TOPK);
        epx_ll_dispatch_result_t result = EPX_LL_DISPATCH_RESULT_INIT;
        epx_status_t status = epx_ll_dispatch(buffer, &args, &result, NULL);
        CHECK(status == EPX_ERR_UNSUPPORTED || status == EPX_ERR_INVALID_ARG);
        printf("test_ll: %s backend has no low-latency mode yet (skipped)\n",
               epx_backend_name(info.backend));
        CHECK_OK(epx_buffer_destroy(buffer));
        CHECK_OK(epx_group_destroy(group));
        return 0;
    }
    moe_ll_cast_t bf16 = {0, 0, 0}, fp8 = {1, 0, 0}, fp8_pow2 = {1, 1, 0}, ue8m0 = {1, 1, 1};
    run_blocking("bf16", 256, bf16, -1);
    run_blocking("fp8 fp32 scales", 256, fp8, -1);
    run_blocking("fp8 power-of-two scales", 384, fp8_pow2, -1);
    run_blocking("fp8 ue8m0", 512, ue8m0, -1);
    run_blocking("empty rank", 128, bf16, info.world_size - 1);
    run_overlap();
    run_misuse();
    if (info.world_size >= 2)
        run_masked();
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_group_destroy(group));
    printf("test_ll: ok (rank %d of %d)\n", info.rank, info.world_size);
    return 0;
}
