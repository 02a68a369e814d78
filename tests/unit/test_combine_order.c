/*
 * Combine's summation order across nodes (docs/INTERNODE.md): inside each node the rows
 * of the ranks that received a token are summed in rank order in fp32, each node's sum
 * is rounded to one bf16 partial, and the partials are summed in node order in fp32;
 * top-k weights the same way without the rounding.
 *
 * Shown here, on random inputs from a seed:
 *   - the oracle (tests/common/moe_case.c) follows that formula, which gives the flat
 *     rank-order sum on one node and on nodes of one rank, and differs from it on some
 *     elements otherwise (so a test with the wrong order can fail);
 *   - the host backend, with the group's ranks_per_node, gives the oracle's bits exactly
 *     (x and top-k weights) at 2 x 4 and 4 x 2 ranks, with forked ranks.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epx.h"
#include "fork_ranks.h"
#include "moe_case.h"
#include "test_util.h"

#define WORLD 8

static moe_case_t random_case(int ranks_per_node)
{
    moe_case_t c = {0};
    c.world_size = WORLD;
    c.num_tokens = 64;
    c.hidden = 256;
    c.num_experts = 32;
    c.num_topk = 6;
    c.dtype = EPX_DTYPE_BF16;
    c.expert_alignment = 1;
    c.seed = 4242;
    c.routing = MOE_ROUTING_RANDOM;
    c.drop_fraction = 0.1;
    c.empty_rank = 5;
    c.ranks_per_node = ranks_per_node;
    return c;
}

/* The weight rank `recv_rank` returns for entry j of token (src_rank, src_token): any
 * fp32 in [-1, 1) with a full mantissa, so different sum orders round differently. */
static float returned_weight(int recv_rank, int src_rank, int64_t src_token, int j)
{
    uint64_t z = ((uint64_t)recv_rank << 48) ^ ((uint64_t)src_rank << 40) ^
                 ((uint64_t)src_token << 8) ^ (uint64_t)j;
    z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdull;
    z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ull;
    z ^= z >> 33;
    return (float)((double)(z >> 40) / (double)(1ull << 23) - 1.0);
}

/* Does token t of `rank` go to rank r? (the oracle's layout of rank's own inputs) */
static int goes_to(const moe_expected_t *e, int64_t t, int r)
{
    return e->is_token_in_rank[t * WORLD + r] != 0;
}

/*
 * The combined weights of `rank`'s tokens, [tokens, k]: per node, the fp32 sum in rank
 * order of the receivers' weights; the node sums added in node order. per_node WORLD
 * gives the flat order.
 */
static float *expected_weights(const moe_case_t *c, int rank, const moe_expected_t *e,
                               int per_node)
{
    int64_t n = moe_tokens_of_rank(c, rank);
    int k = c->num_topk;
    float *out = calloc((size_t)(n * k) + 1, sizeof(float));
    CHECK(out != NULL);
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            float total = 0.0f;
            for (int node = 0; node < WORLD / per_node; node++) {
                float partial = 0.0f;
                int received = 0;
                for (int r = node * per_node; r < (node + 1) * per_node; r++)
                    if (goes_to(e, t, r)) {
                        partial += returned_weight(r, rank, t, j);
                        received = 1;
                    }
                if (received)
                    total += partial;
            }
            out[t * k + j] = total;
        }
    return out;
}

/* ---------------------------------------------------------------- the oracle */

/* Token t's row worked out here from moe_combine_row, node by node. */
static void nested_row(const moe_case_t *c, int rank, const moe_expected_t *e, int64_t t,
                       int per_node, uint16_t *out)
{
    uint16_t row[256];
    float total[256] = {0};
    for (int node = 0; node < WORLD / per_node; node++) {
        float partial[256] = {0};
        int received = 0;
        for (int r = node * per_node; r < (node + 1) * per_node; r++) {
            if (!goes_to(e, t, r))
                continue;
            received = 1;
            moe_combine_row(c, r, rank, t, row);
            for (int i = 0; i < 256; i++)
                partial[i] += moe_bf16_to_float(row[i]);
        }
        for (int i = 0; received && i < 256; i++)
            total[i] += moe_bf16_to_float(moe_float_to_bf16(partial[i]));
    }
    for (int i = 0; i < 256; i++)
        out[i] = moe_float_to_bf16(total[i]);
}

/* Elements of every rank's combine output where node size `per_node` differs from the
 * flat order; checks the oracle against nested_row on the way. */
static int64_t oracle_differences(int per_node)
{
    moe_case_t flat = random_case(0), nested = random_case(per_node);
    int64_t differ = 0;
    for (int rank = 0; rank < WORLD; rank++) {
        moe_expected_t e;
        uint16_t *want_flat, *want_nested, row[256];
        CHECK_EQ_INT(moe_oracle_dispatch(&nested, rank, &e), 0);
        CHECK_EQ_INT(moe_oracle_combine(&flat, rank, &want_flat), 0);
        CHECK_EQ_INT(moe_oracle_combine(&nested, rank, &want_nested), 0);
        int64_t n = moe_tokens_of_rank(&nested, rank);
        for (int64_t t = 0; t < n; t++) {
            nested_row(&nested, rank, &e, t, per_node, row);
            CHECK(memcmp(row, want_nested + t * 256, sizeof row) == 0);
        }
        for (int64_t i = 0; i < n * 256; i++)
            differ += want_flat[i] != want_nested[i];
        free(want_flat);
        free(want_nested);
        moe_expected_free(&e);
    }
    return differ;
}

static void check_oracle(void)
{
    /* One node, however it is said, and nodes of one rank: the flat order. */
    CHECK_EQ_INT(oracle_differences(WORLD), 0);
    CHECK_EQ_INT(oracle_differences(1), 0);
    /* Partials of two or more ranks rounded to bf16: some elements change. */
    int64_t differ_2x4 = oracle_differences(4), differ_4x2 = oracle_differences(2);
    printf("oracle: nested order differs from the flat one in %lld (2x4) and %lld (4x2) "
           "of %d elements\n",
           (long long)differ_2x4, (long long)differ_4x2, 7 * 64 * 256);
    CHECK(differ_2x4 > 0);
    CHECK(differ_4x2 > 0);

    /* The weights' order matters too, on the same routing. */
    moe_case_t c = random_case(4);
    int64_t weights_differ = 0;
    for (int rank = 0; rank < WORLD; rank++) {
        moe_expected_t e;
        CHECK_EQ_INT(moe_oracle_dispatch(&c, rank, &e), 0);
        float *a = expected_weights(&c, rank, &e, WORLD), *b = expected_weights(&c, rank, &e, 4);
        for (int64_t i = 0; i < moe_tokens_of_rank(&c, rank) * c.num_topk; i++)
            weights_differ += memcmp(&a[i], &b[i], sizeof(float)) != 0;
        free(a);
        free(b);
        moe_expected_free(&e);
    }
    CHECK(weights_differ > 0);

    /* A node size that does not divide the world is not a case. */
    moe_case_t bad = random_case(3);
    uint16_t *out;
    CHECK_EQ_INT(moe_oracle_combine(&bad, 0, &out), -1);
}

/* ---------------------------------------------------------------- the host backend */

typedef struct {
    epx_unique_id_t id;
    int per_node;
} group_arg_t;

static int backend_rank(int rank, int world, void *opaque)
{
    const group_arg_t *arg = opaque;
    moe_case_t c = random_case(arg->per_node);
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = world;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = &arg->id;
    config.ranks_per_node = arg->per_node;
    config.timeout_ms = 15000;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.ranks_per_node, arg->per_node);

    epx_buffer_config_t buffer_config = EPX_BUFFER_CONFIG_INIT;
    buffer_config.max_tokens_per_rank = c.num_tokens;
    buffer_config.hidden = c.hidden;
    buffer_config.num_experts = c.num_experts;
    buffer_config.num_topk = c.num_topk;
    epx_buffer_t buffer = NULL;
    CHECK_OK(epx_buffer_create(group, &buffer_config, &buffer));

    moe_inputs_t in;
    moe_expected_t e;
    CHECK_EQ_INT(moe_inputs_make(&c, rank, &in), 0);
    CHECK_EQ_INT(moe_oracle_dispatch(&c, rank, &e), 0);
    int64_t n = in.num_tokens, h = c.hidden;
    int k = c.num_topk;
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    args.x = epx_tensor_2d(in.x, EPX_DTYPE_BF16, n, h);
    args.topk_idx = epx_tensor_2d(in.topk_idx, EPX_DTYPE_INT64, n, k);
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    CHECK_EQ_INT(res.num_recv_tokens, e.num_recv);

    /* Expert outputs and weights for the received rows, in receive order. */
    uint16_t *rows = calloc((size_t)(e.num_recv * h) + 1, 2);
    float *weights = calloc((size_t)(e.num_recv * k) + 1, 4);
    uint16_t *out_x = calloc((size_t)(n * h) + 1, 2);
    float *out_weights = calloc((size_t)(n * k) + 1, 4);
    CHECK(rows != NULL && weights != NULL && out_x != NULL && out_weights != NULL);
    for (int64_t i = 0; i < e.num_recv; i++) {
        moe_combine_row(&c, rank, e.recv_src_rank[i], e.recv_src_token[i], rows + i * h);
        for (int j = 0; j < k; j++)
            weights[i * k + j] = returned_weight(rank, e.recv_src_rank[i], e.recv_src_token[i], j);
    }
    epx_combine_args_t cargs = EPX_COMBINE_ARGS_INIT;
    cargs.handle = res.handle;
    cargs.x = epx_tensor_2d(rows, EPX_DTYPE_BF16, e.num_recv, h);
    cargs.topk_weights = epx_tensor_2d(weights, EPX_DTYPE_FP32, e.num_recv, k);
    cargs.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, h);
    cargs.out_topk_weights = epx_tensor_2d(out_weights, EPX_DTYPE_FP32, n, k);
    CHECK_OK(epx_combine(buffer, &cargs, NULL));

    uint16_t *want;
    CHECK_EQ_INT(moe_oracle_combine(&c, rank, &want), 0);
    for (int64_t i = 0; i < n * h; i++)
        if (out_x[i] != want[i])
            TEST_FAIL("%dx%d rank %d: out_x[%lld][%lld] is 0x%04x, the oracle's 0x%04x",
                      WORLD / arg->per_node, arg->per_node, rank, (long long)(i / h),
                      (long long)(i % h), out_x[i], want[i]);
    float *want_weights = expected_weights(&c, rank, &e, arg->per_node);
    for (int64_t i = 0; i < n * k; i++)
        if (memcmp(&out_weights[i], &want_weights[i], sizeof(float)) != 0)
            TEST_FAIL("%dx%d rank %d: out_topk_weights[%lld][%d] is %.9g, expected %.9g",
                      WORLD / arg->per_node, arg->per_node, rank, (long long)(i / k),
                      (int)(i % k), out_weights[i], want_weights[i]);

    CHECK_OK(epx_handle_destroy(res.handle));
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_OK(epx_group_destroy(group));
    free(want);
    free(want_weights);
    free(rows);
    free(weights);
    free(out_x);
    free(out_weights);
    moe_expected_free(&e);
    moe_inputs_free(&in);
    return 0;
}

static void check_backend(int per_node)
{
    group_arg_t arg;
    arg.per_node = per_node;
    CHECK_OK(epx_get_unique_id(&arg.id));
    char what[64];
    snprintf(what, sizeof what, "host backend %dx%d", WORLD / per_node, per_node);
    CHECK_EQ_INT(run_ranks(what, WORLD, WORLD, backend_rank, &arg), 0);
    printf("ok   %s: combine x and weights equal the oracle bit for bit\n", what);
}

int main(void)
{
    check_oracle();
    check_backend(4);
    check_backend(2);
    printf("test_combine_order: ok\n");
    return 0;
}
