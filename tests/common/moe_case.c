/*
 * Deterministic MoE inputs and the pure reference of docs/DESIGN.md section 2.
 *
 * This file is the independent check on src/: it shares no code with the library and
 * is written to be obviously right rather than fast. Every random value is a pure
 * function of (seed, rank, stream, index) through a counter-based generator, so any
 * rank can regenerate any other rank's inputs, values do not depend on the order of
 * calls, and the oracle regenerates only the rows it needs.
 */
#include "moe_case.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Independent random streams: one per kind of value. */
enum {
    STREAM_X = 1,
    STREAM_SCALES = 2,
    STREAM_EXPERT = 3,
    STREAM_DROP = 4,
    STREAM_WEIGHT = 5,
    STREAM_COMBINE = 6,
};

/* ---------------------------------------------------------------- random numbers */

uint64_t moe_splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/*
 * A random 64-bit word, a pure function of its five coordinates. The first four make a
 * row key, so a row of values costs one mix per word (random_word_in_row).
 */
static uint64_t random_row_key(uint64_t seed, uint64_t rank, uint64_t stream, uint64_t a)
{
    uint64_t h = moe_splitmix64(seed);
    h = moe_splitmix64(h ^ rank);
    h = moe_splitmix64(h ^ (stream << 32));
    return moe_splitmix64(h ^ a);
}

static uint64_t random_word_in_row(uint64_t row_key, uint64_t b)
{
    return moe_splitmix64(row_key ^ b);
}

static uint64_t random_word(uint64_t seed, uint64_t rank, uint64_t stream, uint64_t a,
                            uint64_t b)
{
    return random_word_in_row(random_row_key(seed, rank, stream, a), b);
}

/* 16 random bits for element i of a row: four elements share one word. */
static uint32_t random_bits16_in_row(uint64_t row_key, int64_t i)
{
    uint64_t word = random_word_in_row(row_key, (uint64_t)(i / 4));
    return (uint32_t)(word >> (16 * (i % 4))) & 0xffffu;
}

/* Uniform in [-4, 4) from 16 bits (bf16 keeps only 8 of them anyway). */
static float random_symmetric4(uint32_t bits16)
{
    return (float)bits16 * (8.0f / 65536.0f) - 4.0f;
}

/* Uniform in [0, 1) with 53 random bits. */
static double random_unit(uint64_t word)
{
    return (double)(word >> 11) * (1.0 / 9007199254740992.0);
}

/* ---------------------------------------------------------------- bf16 */

float moe_bf16_to_float(uint16_t bits)
{
    uint32_t word = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

uint16_t moe_float_to_bf16(float value)
{
    uint32_t word;
    memcpy(&word, &value, sizeof word);
    if (isnan(value))
        return 0x7fc0;
    /* Round to nearest even: add half an ulp of bf16, plus one if the kept lsb is 1. */
    uint32_t lsb = (word >> 16) & 1u;
    word += 0x7fffu + lsb;
    return (uint16_t)(word >> 16);
}

size_t moe_registered_size(size_t bytes)
{
    const size_t two_mib = (size_t)2 << 20;
    return (bytes + two_mib - 1) / two_mib * two_mib;
}

/* ---------------------------------------------------------------- inputs, per token */

static int64_t tokens_of_rank(const moe_case_t *c, int rank)
{
    return rank == c->empty_rank ? 0 : c->num_tokens;
}

int64_t moe_tokens_of_rank(const moe_case_t *c, int rank)
{
    return tokens_of_rank(c, rank);
}

static int64_t scales_per_row(const moe_case_t *c)
{
    return c->hidden / 128;
}

static size_t x_element_size(const moe_case_t *c)
{
    return c->dtype == EPX_DTYPE_FP8_E4M3 ? 1 : 2;
}

static int home_rank_of_expert(const moe_case_t *c, int64_t expert)
{
    return (int)(expert / (c->num_experts / c->world_size));
}

/* Row `token` of rank `rank`'s x, written to `row` (hidden elements). */
static void make_x_row(const moe_case_t *c, int rank, int64_t token, void *row)
{
    uint64_t key = random_row_key(c->seed, (uint64_t)rank, STREAM_X, (uint64_t)token);
    for (int64_t i = 0; i < c->hidden; i++) {
        uint32_t bits = random_bits16_in_row(key, i);
        if (c->dtype == EPX_DTYPE_FP8_E4M3) {
            /* Any byte but the two NaN encodings of e4m3 (S.1111.111). */
            uint8_t byte = (uint8_t)(bits % 254);
            if (byte >= 0x7f)
                byte++;
            ((uint8_t *)row)[i] = byte;
        } else {
            /* In [-4, 4), never exactly zero so a lost row is always visible. */
            float value = random_symmetric4(bits);
            if (value == 0.0f)
                value = 0.5f;
            ((uint16_t *)row)[i] = moe_float_to_bf16(value);
        }
    }
}

static void make_scales_row(const moe_case_t *c, int rank, int64_t token, float *row)
{
    uint64_t key = random_row_key(c->seed, (uint64_t)rank, STREAM_SCALES, (uint64_t)token);
    for (int64_t i = 0; i < scales_per_row(c); i++)
        row[i] = (float)(0.25 + random_unit(random_word_in_row(key, (uint64_t)i)) * 3.75);
}

static int already_chosen(const int64_t *idx, int count, int64_t expert)
{
    for (int j = 0; j < count; j++)
        if (idx[j] == expert)
            return 1;
    return 0;
}

/* Token `token` of rank `rank`: its num_topk expert ids (-1 = none) and weights. */
static void make_routing_row(const moe_case_t *c, int rank, int64_t token, int64_t *idx,
                             float *weights)
{
    int k = c->num_topk;
    int experts_per_rank = c->num_experts / c->world_size;
    uint64_t draw = 0; /* counter of rejection-sampling draws for this token */
    int chosen = 0;

    if (c->routing == MOE_ROUTING_ONE_EXPERT) {
        idx[0] = 0;
        for (int j = 1; j < k; j++)
            idx[j] = -1;
        chosen = k;
    } else if (c->routing == MOE_ROUTING_LOCAL_FIRST) {
        uint64_t word = random_word(c->seed, (uint64_t)rank, STREAM_EXPERT, (uint64_t)token,
                                    draw++);
        idx[chosen++] = (int64_t)rank * experts_per_rank + (int64_t)(word % experts_per_rank);
    }
    /* Distinct experts, uniform: redraw on a repeat (k <= num_experts ends the loop). */
    while (chosen < k) {
        uint64_t word = random_word(c->seed, (uint64_t)rank, STREAM_EXPERT, (uint64_t)token,
                                    draw++);
        int64_t expert = (int64_t)(word % (uint64_t)c->num_experts);
        if (!already_chosen(idx, chosen, expert))
            idx[chosen++] = expert;
    }

    if (c->routing == MOE_ROUTING_REPEAT && k >= 2)
        idx[k - 1] = idx[0];

    for (int j = 0; j < k; j++) {
        uint64_t drop = random_word(c->seed, (uint64_t)rank, STREAM_DROP, (uint64_t)token,
                                    (uint64_t)j);
        if (c->drop_fraction > 0 && random_unit(drop) < c->drop_fraction)
            idx[j] = -1;
        uint64_t word = random_word(c->seed, (uint64_t)rank, STREAM_WEIGHT, (uint64_t)token,
                                    (uint64_t)j);
        weights[j] = (float)(1.0 - random_unit(word)); /* in (0, 1] */
    }
}

/* Does token (idx row) have an expert on rank `dest`? */
static int token_goes_to(const moe_case_t *c, const int64_t *idx, int dest)
{
    for (int j = 0; j < c->num_topk; j++)
        if (idx[j] >= 0 && home_rank_of_expert(c, idx[j]) == dest)
            return 1;
    return 0;
}

static int case_is_valid(const moe_case_t *c)
{
    return c->world_size >= 1 && c->num_tokens >= 0 && c->hidden >= 1 &&
           c->num_experts >= 1 && c->num_experts % c->world_size == 0 && c->num_topk >= 1 &&
           c->num_topk <= c->num_experts && c->ranks_per_node >= 0 &&
           (c->ranks_per_node == 0 || c->world_size % c->ranks_per_node == 0);
}

/* Ranks per node: the whole world when the case says 0 (one node). */
static int node_size(const moe_case_t *c)
{
    return c->ranks_per_node > 0 ? c->ranks_per_node : c->world_size;
}

/* calloc that never returns NULL for a zero count, so an empty tensor is still "given". */
static void *alloc_zeroed(int64_t count, size_t element_size)
{
    return calloc(count > 0 ? (size_t)count : 1, element_size);
}

/* ---------------------------------------------------------------- inputs */

int moe_inputs_make(const moe_case_t *c, int rank, moe_inputs_t *in)
{
    memset(in, 0, sizeof *in);
    if (!case_is_valid(c))
        return -1;
    int64_t n = tokens_of_rank(c, rank);
    int k = c->num_topk;
    int fp8 = c->dtype == EPX_DTYPE_FP8_E4M3;

    in->num_tokens = n;
    in->x = alloc_zeroed(n * c->hidden, x_element_size(c));
    in->x_scales = fp8 ? alloc_zeroed(n * scales_per_row(c), sizeof(float)) : NULL;
    in->topk_idx = alloc_zeroed(n * k, sizeof(int64_t));
    in->topk_weights = alloc_zeroed(n * k, sizeof(float));
    if (in->x == NULL || (fp8 && in->x_scales == NULL) || in->topk_idx == NULL ||
        in->topk_weights == NULL) {
        moe_inputs_free(in);
        return -1;
    }
    for (int64_t t = 0; t < n; t++) {
        make_x_row(c, rank, t, (char *)in->x + (size_t)(t * c->hidden) * x_element_size(c));
        if (fp8)
            make_scales_row(c, rank, t, in->x_scales + t * scales_per_row(c));
        make_routing_row(c, rank, t, in->topk_idx + t * k, in->topk_weights + t * k);
    }
    return 0;
}

void moe_inputs_free(moe_inputs_t *in)
{
    free(in->x);
    free(in->x_scales);
    free(in->topk_idx);
    free(in->topk_weights);
    memset(in, 0, sizeof *in);
}

int64_t moe_routing_make(const moe_case_t *c, int rank, int64_t *topk_idx)
{
    if (!case_is_valid(c) || rank < 0 || rank >= c->world_size)
        return -1;
    float *weights = alloc_zeroed(c->num_topk, sizeof(float));
    if (weights == NULL)
        return -1;
    int64_t n = tokens_of_rank(c, rank);
    for (int64_t t = 0; t < n; t++)
        make_routing_row(c, rank, t, topk_idx + t * c->num_topk, weights);
    free(weights);
    return n;
}

/* ---------------------------------------------------------------- dispatch oracle */

/* The layout of rank `rank`'s own inputs: counts per rank and expert, token-in-rank. */
static void fill_layout(const moe_case_t *c, int rank, moe_expected_t *e, int64_t *idx,
                        float *weights)
{
    int64_t n = tokens_of_rank(c, rank);
    int world = c->world_size;
    for (int64_t t = 0; t < n; t++) {
        make_routing_row(c, rank, t, idx, weights);
        for (int d = 0; d < world; d++) {
            int in_rank = token_goes_to(c, idx, d);
            e->is_token_in_rank[t * world + d] = (uint8_t)in_rank;
            e->num_tokens_per_rank[d] += in_rank;
        }
        /* An expert named twice in a row counts once. */
        for (int j = 0; j < c->num_topk; j++)
            if (idx[j] >= 0 && !already_chosen(idx, j, idx[j]))
                e->num_tokens_per_expert[idx[j]]++;
    }
}

/* How many rows rank `rank` receives: one per (source rank, token) with an expert here. */
static int64_t count_received(const moe_case_t *c, int rank, int64_t *idx, float *weights)
{
    int64_t count = 0;
    for (int s = 0; s < c->world_size; s++)
        for (int64_t t = 0; t < tokens_of_rank(c, s); t++) {
            make_routing_row(c, s, t, idx, weights);
            count += token_goes_to(c, idx, rank);
        }
    return count;
}

/* Copy one received token into row `row` of the expected outputs. */
static void fill_received_row(const moe_case_t *c, int rank, int s, int64_t t, int64_t row,
                              const int64_t *idx, const float *weights, moe_expected_t *e)
{
    int k = c->num_topk;
    int64_t first_local = (int64_t)rank * e->num_local_experts;

    make_x_row(c, s, t, (char *)e->recv_x + (size_t)(row * c->hidden) * x_element_size(c));
    if (c->dtype == EPX_DTYPE_FP8_E4M3)
        make_scales_row(c, s, t, e->recv_x_scales + row * scales_per_row(c));
    for (int j = 0; j < k; j++) {
        int here = idx[j] >= 0 && home_rank_of_expert(c, idx[j]) == rank;
        e->recv_topk_idx[row * k + j] = here ? idx[j] - first_local : -1;
        e->recv_topk_weights[row * k + j] = here ? weights[j] : 0.0f;
        if (here && !already_chosen(idx, j, idx[j])) /* twice in a row counts once */
            e->num_recv_per_expert[idx[j] - first_local]++;
    }
    e->recv_src_rank[row] = s;
    e->recv_src_token[row] = (int32_t)t;
}

int moe_oracle_dispatch(const moe_case_t *c, int rank, moe_expected_t *e)
{
    memset(e, 0, sizeof *e);
    if (!case_is_valid(c) || rank < 0 || rank >= c->world_size)
        return -1;
    int world = c->world_size;
    int k = c->num_topk;
    int fp8 = c->dtype == EPX_DTYPE_FP8_E4M3;
    int64_t *idx = alloc_zeroed(k, sizeof(int64_t));
    float *weights = alloc_zeroed(k, sizeof(float));
    if (idx == NULL || weights == NULL)
        goto err_oom;

    e->num_local_experts = c->num_experts / world;
    e->num_recv = count_received(c, rank, idx, weights);
    e->recv_x = alloc_zeroed(e->num_recv * c->hidden, x_element_size(c));
    e->recv_x_scales = fp8 ? alloc_zeroed(e->num_recv * scales_per_row(c), sizeof(float))
                           : NULL;
    e->recv_topk_idx = alloc_zeroed(e->num_recv * k, sizeof(int64_t));
    e->recv_topk_weights = alloc_zeroed(e->num_recv * k, sizeof(float));
    e->recv_src_rank = alloc_zeroed(e->num_recv, sizeof(int32_t));
    e->recv_src_token = alloc_zeroed(e->num_recv, sizeof(int32_t));
    e->num_recv_per_expert = alloc_zeroed(e->num_local_experts, sizeof(int32_t));
    e->num_tokens_per_rank = alloc_zeroed(world, sizeof(int32_t));
    e->num_tokens_per_expert = alloc_zeroed(c->num_experts, sizeof(int32_t));
    e->is_token_in_rank = alloc_zeroed(tokens_of_rank(c, rank) * world, sizeof(uint8_t));
    if (e->recv_x == NULL || (fp8 && e->recv_x_scales == NULL) || e->recv_topk_idx == NULL ||
        e->recv_topk_weights == NULL || e->recv_src_rank == NULL ||
        e->recv_src_token == NULL || e->num_recv_per_expert == NULL ||
        e->num_tokens_per_rank == NULL || e->num_tokens_per_expert == NULL ||
        e->is_token_in_rank == NULL)
        goto err_oom;

    /* Source rank order, then source token order: the order section 2 requires. */
    int64_t row = 0;
    for (int s = 0; s < world; s++)
        for (int64_t t = 0; t < tokens_of_rank(c, s); t++) {
            make_routing_row(c, s, t, idx, weights);
            if (token_goes_to(c, idx, rank))
                fill_received_row(c, rank, s, t, row++, idx, weights, e);
        }

    if (c->expert_alignment > 1)
        for (int j = 0; j < e->num_local_experts; j++) {
            int32_t a = c->expert_alignment;
            e->num_recv_per_expert[j] = (e->num_recv_per_expert[j] + a - 1) / a * a;
        }

    fill_layout(c, rank, e, idx, weights);
    free(idx);
    free(weights);
    return 0;

err_oom:
    free(idx);
    free(weights);
    moe_expected_free(e);
    return -1;
}

void moe_expected_free(moe_expected_t *e)
{
    free(e->recv_x);
    free(e->recv_x_scales);
    free(e->recv_topk_idx);
    free(e->recv_topk_weights);
    free(e->recv_src_rank);
    free(e->recv_src_token);
    free(e->num_recv_per_expert);
    free(e->num_tokens_per_rank);
    free(e->num_tokens_per_expert);
    free(e->is_token_in_rank);
    memset(e, 0, sizeof *e);
}

/* ---------------------------------------------------------------- combine oracle */

void moe_combine_row(const moe_case_t *c, int recv_rank, int src_rank, int64_t src_token,
                     uint16_t *row)
{
    if (c->cancelling_rows) {
        int64_t idx[256];
        float weights[256];
        int lowest = -1, highest = -1, receivers = 0;
        if (c->num_topk <= 256) {
            make_routing_row(c, src_rank, src_token, idx, weights);
            for (int r = 0; r < c->world_size; r++)
                if (token_goes_to(c, idx, r)) {
                    lowest = lowest < 0 ? r : lowest;
                    highest = r;
                    receivers++;
                }
        }
        if (receivers >= 3 && (recv_rank == lowest || recv_rank == highest)) {
            uint16_t big = moe_float_to_bf16(recv_rank == lowest ? 65536.0f : -65536.0f);
            for (int64_t i = 0; i < c->hidden; i++)
                row[i] = big;
            return;
        }
    }
    /* The stream folds in the receiving rank so each rank's row differs. */
    uint64_t stream = STREAM_COMBINE + ((uint64_t)recv_rank << 8);
    uint64_t seed = c->combine_salt == 0 ? c->seed : moe_splitmix64(c->seed ^ c->combine_salt);
    uint64_t key = random_row_key(seed, (uint64_t)src_rank, stream, (uint64_t)src_token);
    for (int64_t i = 0; i < c->hidden; i++)
        row[i] = moe_float_to_bf16(random_symmetric4(random_bits16_in_row(key, i)));
}

/*
 * The ranks that receive token t, in the order their rows are added: rank order, or with
 * `topk_order` DeepEP V2's: each rank where its last entry in idx stands. Returns how
 * many were written to `ranks` ([world_size]).
 */
static int summation_order(const moe_case_t *c, const int64_t *idx, int topk_order, int *ranks)
{
    int n = 0;
    if (!topk_order) {
        for (int r = 0; r < c->world_size; r++)
            if (token_goes_to(c, idx, r))
                ranks[n++] = r;
        return n;
    }
    for (int j = 0; j < c->num_topk; j++) {
        if (idx[j] < 0)
            continue;
        int r = home_rank_of_expert(c, idx[j]), named_later = 0;
        for (int later = j + 1; later < c->num_topk; later++)
            named_later |= idx[later] >= 0 && home_rank_of_expert(c, idx[later]) == r;
        if (!named_later)
            ranks[n++] = r;
    }
    return n;
}

/*
 * One token's output row: from its biases (`bias` rows, NULL: none), the rows of its
 * receivers summed node by node (the formula in moe_case.h), in summation_order: a node
 * where its last receiver stands, its receivers in that order. On one node the rows go
 * straight into the total: without biases the same bits as a partial rounded to bf16,
 * with them DeepEP's flat order. `partial` and `total` are [hidden] scratch, `ranks`
 * [world_size].
 */
static void combine_token(const moe_case_t *c, int rank, int64_t t, const int64_t *idx,
                          const uint16_t *const bias[2], int topk_order, int *ranks,
                          float *partial, float *total, uint16_t *row, uint16_t *out)
{
    int64_t hidden = c->hidden;
    int per_node = node_size(c);
    int one_node = per_node == c->world_size;
    for (int64_t i = 0; i < hidden; i++)
        total[i] = 0.0f;
    for (int b = 0; b < 2; b++)
        for (int64_t i = 0; bias[b] != NULL && i < hidden; i++)
            total[i] += moe_bf16_to_float(bias[b][t * hidden + i]);
    int n = summation_order(c, idx, topk_order, ranks);
    for (int k = 0; k < n; k++) {
        int node = ranks[k] / per_node, node_later = 0;
        for (int later = k + 1; later < n; later++)
            node_later |= ranks[later] / per_node == node;
        if (node_later && !one_node)
            continue; /* the node is added where its last receiver stands */
        if (one_node) {
            moe_combine_row(c, ranks[k], rank, t, row);
            for (int64_t i = 0; i < hidden; i++)
                total[i] += moe_bf16_to_float(row[i]);
            continue;
        }
        for (int64_t i = 0; i < hidden; i++)
            partial[i] = 0.0f;
        for (int m = 0; m <= k; m++) {
            if (ranks[m] / per_node != node)
                continue;
            moe_combine_row(c, ranks[m], rank, t, row);
            for (int64_t i = 0; i < hidden; i++)
                partial[i] += moe_bf16_to_float(row[i]);
        }
        /* The node's partial crosses the network as bf16. */
        for (int64_t i = 0; i < hidden; i++)
            total[i] += moe_bf16_to_float(moe_float_to_bf16(partial[i]));
    }
    /* A token sent nowhere (without biases) sums to +0, whose bf16 bits are 0. */
    for (int64_t i = 0; i < hidden; i++)
        out[i] = moe_float_to_bf16(total[i]);
}

int moe_oracle_combine(const moe_case_t *c, int rank, uint16_t **out_x)
{
    return moe_oracle_combine_ordered(c, rank, NULL, NULL, 0, out_x);
}

int moe_oracle_combine_biased(const moe_case_t *c, int rank, const uint16_t *bias0,
                              const uint16_t *bias1, uint16_t **out_x)
{
    return moe_oracle_combine_ordered(c, rank, bias0, bias1, 0, out_x);
}

int moe_oracle_combine_ordered(const moe_case_t *c, int rank, const uint16_t *bias0,
                               const uint16_t *bias1, int topk_order, uint16_t **out_x)
{
    const uint16_t *const bias[2] = {bias0, bias1};
    *out_x = NULL;
    if (!case_is_valid(c) || rank < 0 || rank >= c->world_size)
        return -1;
    int64_t n = tokens_of_rank(c, rank);
    int64_t hidden = c->hidden;
    uint16_t *out = alloc_zeroed(n * hidden, sizeof(uint16_t));
    float *partial = alloc_zeroed(hidden, sizeof(float));
    float *total = alloc_zeroed(hidden, sizeof(float));
    uint16_t *row = alloc_zeroed(hidden, sizeof(uint16_t));
    int64_t *idx = alloc_zeroed(c->num_topk, sizeof(int64_t));
    float *weights = alloc_zeroed(c->num_topk, sizeof(float));
    int *ranks = alloc_zeroed(c->world_size, sizeof(int));
    int ok = out != NULL && partial != NULL && total != NULL && row != NULL && idx != NULL &&
             weights != NULL && ranks != NULL;
    for (int64_t t = 0; ok && t < n; t++) {
        make_routing_row(c, rank, t, idx, weights);
        combine_token(c, rank, t, idx, bias, topk_order, ranks, partial, total, row,
                      out + t * hidden);
    }
    free(ranks);
    free(partial);
    free(total);
    free(row);
    free(idx);
    free(weights);
    if (!ok) {
        free(out);
        return -1;
    }
    *out_x = out;
    return 0;
}
