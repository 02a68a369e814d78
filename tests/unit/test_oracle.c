/*
 * Checks the test oracle itself (tests/common/moe_case.c, and the fp8 cast of moe_ll.c) on
 * cases small enough to work out by hand: 2 ranks, 4 experts (experts 0-1 on rank 0, 2-3
 * on rank 1), 3 tokens.
 * Everything the multi-rank tests trust about the expected results is pinned here.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "moe_case.h"
#include "moe_ll.h"
#include "test_util.h"

static moe_case_t tiny_case(void)
{
    moe_case_t c = {0};
    c.world_size = 2;
    c.num_tokens = 3;
    c.hidden = 128;
    c.num_experts = 4;
    c.num_topk = 2;
    c.dtype = EPX_DTYPE_BF16;
    c.expert_alignment = 1;
    c.seed = 1;
    c.routing = MOE_ROUTING_RANDOM;
    c.drop_fraction = 0.0;
    c.empty_rank = -1;
    return c;
}

static void check_bf16(void)
{
    CHECK_EQ_INT(moe_float_to_bf16(1.0f), 0x3f80);
    CHECK_EQ_INT(moe_float_to_bf16(-2.0f), 0xc000);
    CHECK_EQ_INT(moe_float_to_bf16(0.0f), 0x0000);
    /* Halfway cases round to even; just above halfway rounds up. */
    CHECK_EQ_INT(moe_float_to_bf16(1.0f + 1.0f / 256), 0x3f80);
    CHECK_EQ_INT(moe_float_to_bf16(1.0f + 3.0f / 256), 0x3f82);
    CHECK_EQ_INT(moe_float_to_bf16(1.0f + 1.0f / 256 + 1.0f / 4096), 0x3f81);
    CHECK(moe_bf16_to_float(0x3f80) == 1.0f);
    CHECK(moe_bf16_to_float(0xc040) == -3.0f);
    CHECK(isnan(moe_bf16_to_float(moe_float_to_bf16(NAN))));
}

/*
 * Seed 1 draws these experts (pinned so a change of the generator is noticed):
 *   rank 0: t0 {1,3}  t1 {2,1}  t2 {3,2}
 *   rank 1: t0 {2,1}  t1 {3,0}  t2 {2,1}
 */
static const int64_t tiny_topk[2][6] = {{1, 3, 2, 1, 3, 2}, {2, 1, 3, 0, 2, 1}};

/* The low-latency oracle's fp8 e4m3 ("fn": bias 7, largest 448, 0x7f NaN), worked out by
 * hand: code = exponent << 3 | mantissa, value (1 + m / 8) * 2^(e - 7), or m / 512 when
 * e = 0; the nearest code, ties to the even code, beyond 448 the code of 448. */
static double e4m3_by_hand(int c)
{
    return (c >> 3) == 0 ? (c & 7) / 512.0 : (1.0 + (c & 7) / 8.0) * pow(2.0, (c >> 3) - 7);
}

static void check_e4m3(void)
{
    CHECK_EQ_INT(moe_ll_to_e4m3(0.0f), 0x00);
    CHECK_EQ_INT(moe_ll_to_e4m3(-0.0f), 0x80);
    CHECK_EQ_INT(moe_ll_to_e4m3(1.0f), 0x38);
    CHECK_EQ_INT(moe_ll_to_e4m3(-1.5f), 0xbc);
    CHECK_EQ_INT(moe_ll_to_e4m3(240.0f), 0x77);
    CHECK_EQ_INT(moe_ll_to_e4m3(256.0f), 0x78);
    CHECK_EQ_INT(moe_ll_to_e4m3(448.0f), 0x7e);
    CHECK_EQ_INT(moe_ll_to_e4m3(464.0f), 0x7e);
    CHECK_EQ_INT(moe_ll_to_e4m3(1e9f), 0x7e);
    CHECK_EQ_INT(moe_ll_to_e4m3(-1e9f), 0xfe);
    CHECK_EQ_INT(moe_ll_to_e4m3(NAN), 0x7f);
    /* Subnormals: 1/512 is code 1; 1/1024 ties 0 and 1 (to 0), 3/1024 ties 1 and 2 (to 2). */
    CHECK_EQ_INT(moe_ll_to_e4m3(1.0f / 512), 0x01);
    CHECK_EQ_INT(moe_ll_to_e4m3(1.0f / 1024), 0x00);
    CHECK_EQ_INT(moe_ll_to_e4m3(3.0f / 1024), 0x02);
    CHECK_EQ_INT(moe_ll_to_e4m3(7.0f / 512), 0x07);
    CHECK_EQ_INT(moe_ll_to_e4m3(8.0f / 512), 0x08);
    /* Ties in the normal range go to the even code; just past a tie, to the nearer. */
    CHECK_EQ_INT(moe_ll_to_e4m3(1.0625f), 0x38);
    CHECK_EQ_INT(moe_ll_to_e4m3(1.1875f), 0x3a);
    CHECK_EQ_INT(moe_ll_to_e4m3(1.0626f), 0x39);
    CHECK_EQ_INT(moe_ll_to_e4m3(-1.1874f), 0xb9);

    /* Random magnitudes from a seed, 2^-12 .. 2^10: the code is the nearest one (ties to
     * the even code), or 448's above it; the sign is the input's. */
    uint64_t state = 12345;
    for (int i = 0; i < 200000; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const double a = ldexp(1.0 + (double)(state >> 11) / 9007199254740992.0,
                               (int)((state >> 3) % 22) - 12);
        const float value = (state & 1) ? -(float)a : (float)a;
        const uint8_t code = moe_ll_to_e4m3(value);
        CHECK_EQ_INT(code & 0x80, value < 0 ? 0x80 : 0);
        const int c = code & 0x7f;
        CHECK(c <= 126);
        const double mine = fabs((double)value), at = e4m3_by_hand(c);
        if (mine >= 448.0) {
            CHECK_EQ_INT(c, 126);
            continue;
        }
        const double here = fabs(mine - at);
        const double lower = c > 0 ? fabs(mine - e4m3_by_hand(c - 1)) : INFINITY;
        const double upper = c < 126 ? fabs(mine - e4m3_by_hand(c + 1)) : INFINITY;
        if (!(here < lower || (here == lower && (c & 1) == 0)) ||
            !(here < upper || (here == upper && (c & 1) == 0)))
            TEST_FAIL("e4m3 of %.9g is code %d (%.9g), not the nearest", (double)value, c, at);
    }
}

static void check_tiny_inputs(const moe_case_t *c)
{
    for (int r = 0; r < 2; r++) {
        moe_inputs_t in, again;
        CHECK_EQ_INT(moe_inputs_make(c, r, &in), 0);
        CHECK_EQ_INT(in.num_tokens, 3);
        CHECK(in.x_scales == NULL);
        for (int i = 0; i < 6; i++) {
            CHECK_EQ_INT(in.topk_idx[i], tiny_topk[r][i]);
            CHECK(in.topk_weights[i] > 0.0f && in.topk_weights[i] <= 1.0f);
        }
        for (int64_t i = 0; i < 3 * c->hidden; i++) {
            float v = moe_bf16_to_float(((uint16_t *)in.x)[i]);
            CHECK(v >= -4.0f && v <= 4.0f && v != 0.0f);
        }
        /* Deterministic: a second call gives the same bytes. */
        CHECK_EQ_INT(moe_inputs_make(c, r, &again), 0);
        CHECK(memcmp(in.x, again.x, 3 * 128 * 2) == 0);
        CHECK(memcmp(in.topk_weights, again.topk_weights, 6 * sizeof(float)) == 0);
        moe_inputs_free(&in);
        moe_inputs_free(&again);
    }
}

/* Expected received rows: (source rank, source token, local ids). */
typedef struct {
    int src_rank, src_token;
    int64_t idx[2];
} tiny_row_t;

static const tiny_row_t tiny_recv0[5] = {
    {0, 0, {1, -1}}, {0, 1, {-1, 1}}, {1, 0, {-1, 1}}, {1, 1, {-1, 0}}, {1, 2, {-1, 1}},
};
static const tiny_row_t tiny_recv1[6] = {
    {0, 0, {-1, 1}}, {0, 1, {0, -1}}, {0, 2, {1, 0}},
    {1, 0, {0, -1}}, {1, 1, {1, -1}}, {1, 2, {0, -1}},
};

static void check_tiny_dispatch(const moe_case_t *c, int rank, const tiny_row_t *rows,
                                int64_t num_rows, const int32_t *per_expert,
                                const int32_t *per_rank, const int32_t *per_global_expert,
                                const uint8_t *in_rank)
{
    moe_expected_t e;
    moe_inputs_t src[2];
    CHECK_EQ_INT(moe_oracle_dispatch(c, rank, &e), 0);
    CHECK_EQ_INT(moe_inputs_make(c, 0, &src[0]), 0);
    CHECK_EQ_INT(moe_inputs_make(c, 1, &src[1]), 0);

    CHECK_EQ_INT(e.num_recv, num_rows);
    CHECK_EQ_INT(e.num_local_experts, 2);
    CHECK(e.recv_x_scales == NULL);
    for (int64_t i = 0; i < num_rows; i++) {
        const tiny_row_t *want = &rows[i];
        const moe_inputs_t *in = &src[want->src_rank];
        CHECK_EQ_INT(e.recv_src_rank[i], want->src_rank);
        CHECK_EQ_INT(e.recv_src_token[i], want->src_token);
        CHECK(memcmp((uint16_t *)e.recv_x + i * 128, (uint16_t *)in->x + want->src_token * 128,
                     128 * 2) == 0);
        for (int j = 0; j < 2; j++) {
            CHECK_EQ_INT(e.recv_topk_idx[i * 2 + j], want->idx[j]);
            float w = want->idx[j] >= 0 ? in->topk_weights[want->src_token * 2 + j] : 0.0f;
            CHECK(e.recv_topk_weights[i * 2 + j] == w);
        }
    }
    for (int j = 0; j < 2; j++)
        CHECK_EQ_INT(e.num_recv_per_expert[j], per_expert[j]);
    for (int d = 0; d < 2; d++)
        CHECK_EQ_INT(e.num_tokens_per_rank[d], per_rank[d]);
    for (int x = 0; x < 4; x++)
        CHECK_EQ_INT(e.num_tokens_per_expert[x], per_global_expert[x]);
    for (int i = 0; i < 6; i++)
        CHECK_EQ_INT(e.is_token_in_rank[i], in_rank[i]);
    moe_inputs_free(&src[0]);
    moe_inputs_free(&src[1]);
    moe_expected_free(&e);
}

static void check_alignment(moe_case_t c)
{
    moe_expected_t e0, e1;
    c.expert_alignment = 4;
    CHECK_EQ_INT(moe_oracle_dispatch(&c, 0, &e0), 0);
    CHECK_EQ_INT(moe_oracle_dispatch(&c, 1, &e1), 0);
    CHECK_EQ_INT(e0.num_recv_per_expert[0], 4); /* 1 -> 4 */
    CHECK_EQ_INT(e0.num_recv_per_expert[1], 4); /* 4 stays */
    CHECK_EQ_INT(e1.num_recv_per_expert[0], 4);
    CHECK_EQ_INT(e1.num_recv_per_expert[1], 4); /* 3 -> 4 */
    CHECK_EQ_INT(e0.num_recv, 5);               /* rows are not padded */
    moe_expected_free(&e0);
    moe_expected_free(&e1);
}

/* ONE_EXPERT: every token of both ranks lands on rank 0, expert 0; rank 1 gets none. */
static void check_one_expert(moe_case_t c)
{
    moe_expected_t e0, e1;
    c.routing = MOE_ROUTING_ONE_EXPERT;
    c.expert_alignment = 128;
    CHECK_EQ_INT(moe_oracle_dispatch(&c, 0, &e0), 0);
    CHECK_EQ_INT(moe_oracle_dispatch(&c, 1, &e1), 0);
    CHECK_EQ_INT(e0.num_recv, 6);
    CHECK_EQ_INT(e1.num_recv, 0);
    for (int i = 0; i < 6; i++) {
        CHECK_EQ_INT(e0.recv_src_rank[i], i / 3);
        CHECK_EQ_INT(e0.recv_src_token[i], i % 3);
        CHECK_EQ_INT(e0.recv_topk_idx[i * 2], 0);
        CHECK_EQ_INT(e0.recv_topk_idx[i * 2 + 1], -1);
        CHECK(e0.recv_topk_weights[i * 2 + 1] == 0.0f);
    }
    CHECK_EQ_INT(e0.num_recv_per_expert[0], 128);
    CHECK_EQ_INT(e0.num_recv_per_expert[1], 0);
    CHECK_EQ_INT(e1.num_recv_per_expert[0], 0);
    CHECK_EQ_INT(e1.num_tokens_per_rank[0], 3);
    CHECK_EQ_INT(e1.num_tokens_per_rank[1], 0);

    /* Combine: rank 1's tokens come back as rank 0's row alone, unchanged. */
    uint16_t *out, row[128];
    CHECK_EQ_INT(moe_oracle_combine(&c, 1, &out), 0);
    for (int t = 0; t < 3; t++) {
        moe_combine_row(&c, 0, 1, t, row);
        CHECK(memcmp(out + t * 128, row, sizeof row) == 0);
    }
    free(out);
    moe_expected_free(&e0);
    moe_expected_free(&e1);
}

/* Combine sums the rows of both receivers in fp32, then rounds once to bf16. */
static void check_tiny_combine(const moe_case_t *c)
{
    uint16_t *out, row0[128], row1[128];
    CHECK_EQ_INT(moe_oracle_combine(c, 0, &out), 0);
    /* Token 0 of rank 0 went to both ranks, token 2 only to rank 1. */
    moe_combine_row(c, 0, 0, 0, row0);
    moe_combine_row(c, 1, 0, 0, row1);
    CHECK(memcmp(row0, row1, sizeof row0) != 0); /* receivers send different rows */
    for (int i = 0; i < 128; i++) {
        float want = moe_bf16_to_float(row0[i]) + moe_bf16_to_float(row1[i]);
        CHECK_EQ_INT(out[i], moe_float_to_bf16(want));
    }
    moe_combine_row(c, 1, 0, 2, row1);
    CHECK(memcmp(out + 2 * 128, row1, sizeof row1) == 0);
    free(out);

    /* Every entry dropped: nothing is sent, the output is zeros. */
    moe_case_t dropped = *c;
    dropped.drop_fraction = 1.0;
    CHECK_EQ_INT(moe_oracle_combine(&dropped, 1, &out), 0);
    for (int i = 0; i < 3 * 128; i++)
        CHECK_EQ_INT(out[i], 0);
    free(out);
}

/* Statistical and structural properties on a larger case. */
static void check_properties(void)
{
    moe_case_t c = tiny_case();
    c.world_size = 4;
    c.num_tokens = 500;
    c.hidden = 256;
    c.num_experts = 16;
    c.num_topk = 4;
    c.dtype = EPX_DTYPE_FP8_E4M3;
    c.drop_fraction = 0.3;
    c.routing = MOE_ROUTING_LOCAL_FIRST;
    c.empty_rank = 2;

    moe_inputs_t in;
    CHECK_EQ_INT(moe_inputs_make(&c, 2, &in), 0);
    CHECK_EQ_INT(in.num_tokens, 0);
    CHECK(in.x != NULL && in.topk_idx != NULL); /* empty, but still given */
    moe_inputs_free(&in);

    CHECK_EQ_INT(moe_inputs_make(&c, 1, &in), 0);
    CHECK(in.x_scales != NULL);
    long dropped = 0, first_local = 0, first_kept = 0;
    for (int64_t t = 0; t < 500; t++) {
        const int64_t *idx = in.topk_idx + t * 4;
        for (int j = 0; j < 4; j++) {
            CHECK(idx[j] >= -1 && idx[j] < 16);
            dropped += idx[j] == -1;
            for (int k = 0; k < j; k++)
                CHECK(idx[j] == -1 || idx[j] != idx[k]);
        }
        if (idx[0] >= 0) {
            first_kept++;
            first_local += idx[0] / 4 == 1;
        }
        for (int i = 0; i < 2; i++)
            CHECK(in.x_scales[t * 2 + i] > 0.0f);
    }
    CHECK(first_local == first_kept);
    CHECK(dropped > 500 * 4 * 0.25 && dropped < 500 * 4 * 0.35);
    for (int64_t i = 0; i < 500 * 256; i++) {
        uint8_t byte = ((uint8_t *)in.x)[i];
        CHECK(byte != 0x7f && byte != 0xff);
    }
    moe_inputs_free(&in);

    /* Every token a rank receives is counted once in its sender's per-rank layout. */
    int64_t total_recv = 0, total_sent = 0;
    for (int r = 0; r < 4; r++) {
        moe_expected_t e;
        CHECK_EQ_INT(moe_oracle_dispatch(&c, r, &e), 0);
        total_recv += e.num_recv;
        for (int d = 0; d < 4; d++)
            total_sent += e.num_tokens_per_rank[d];
        for (int64_t i = 1; i < e.num_recv; i++) {
            int64_t prev = (int64_t)e.recv_src_rank[i - 1] * 1000 + e.recv_src_token[i - 1];
            CHECK(prev < (int64_t)e.recv_src_rank[i] * 1000 + e.recv_src_token[i]);
        }
        moe_expected_free(&e);
    }
    CHECK_EQ_INT(total_recv, total_sent);
    CHECK(total_recv > 0);
}

/* Registered allocations are whole 2 MiB blocks, as PyTorch's caching allocator makes them. */
static void check_registered_size(void)
{
    const size_t two_mib = (size_t)2 << 20;
    CHECK(moe_registered_size(1) == two_mib);
    CHECK(moe_registered_size(two_mib) == two_mib);
    CHECK(moe_registered_size(two_mib + 1) == 2 * two_mib);
    CHECK(moe_registered_size((size_t)4097 * 14336 + 16) == 29 * two_mib);
}

int main(void)
{
    moe_case_t c = tiny_case();
    check_bf16();
    check_registered_size();
    check_e4m3();
    check_tiny_inputs(&c);

    static const int32_t per_expert0[2] = {1, 4}, per_expert1[2] = {4, 3};
    static const int32_t per_rank0[2] = {2, 3}, per_rank1[2] = {3, 3};
    static const int32_t per_global0[4] = {0, 2, 2, 2}, per_global1[4] = {1, 2, 2, 1};
    static const uint8_t in_rank0[6] = {1, 1, 1, 1, 0, 1}, in_rank1[6] = {1, 1, 1, 1, 1, 1};
    check_tiny_dispatch(&c, 0, tiny_recv0, 5, per_expert0, per_rank0, per_global0, in_rank0);
    check_tiny_dispatch(&c, 1, tiny_recv1, 6, per_expert1, per_rank1, per_global1, in_rank1);
    check_alignment(c);
    check_one_expert(c);
    check_tiny_combine(&c);
    check_properties();

    /* An invalid case is refused, not miscounted. */
    moe_case_t bad = c;
    bad.num_experts = 3;
    moe_expected_t e;
    CHECK_EQ_INT(moe_oracle_dispatch(&bad, 0, &e), -1);

    printf("test_oracle: ok\n");
    return 0;
}
