/*
 * Low-latency oracle (moe_ll.h). Written from the contract in include/epx.h, not from
 * the library's code: the fp8 rounding searches the table of e4m3 values instead of
 * manipulating bits, and the rows are gathered per receiving expert instead of
 * scattered per sender.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe_ll.h"

int moe_ll_inputs_make(const moe_case_t *c, int rank, moe_inputs_t *in)
{
    if (moe_inputs_make(c, rank, in) != 0)
        return -1;
    if (c->num_topk >= 2 && in->num_tokens > 0 && in->topk_idx[0] >= 0)
        in->topk_idx[1] = in->topk_idx[0];
    return 0;
}

/* Value of the non-negative e4m3 code `code` (0..126); it rises with the code. */
static double e4m3_value(int code)
{
    int exponent = code >> 3, mantissa = code & 7;
    if (exponent == 0)
        return mantissa / 512.0;
    return ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

uint8_t moe_ll_to_e4m3(float value)
{
    if (isnan(value))
        return 0x7f;
    uint8_t sign = value < 0.0f || (value == 0.0f && signbit(value)) ? 0x80 : 0;
    double a = fabs((double)value);
    /* The nearest code, ties to the even one; beyond 448 the nearest code is 448 itself.
     * Bisection for the codes around `a`: low <= a < high. */
    if (a >= e4m3_value(126))
        return sign | 126;
    int low = 0, high = 126;
    while (high - low > 1) {
        int middle = (low + high) / 2;
        if (e4m3_value(middle) <= a)
            low = middle;
        else
            high = middle;
    }
    double below = a - e4m3_value(low), above = e4m3_value(high) - a;
    int best = below < above ? low : above < below ? high : (low & 1) == 0 ? low : high;
    return sign | (uint8_t)best;
}

static int first_position(const int64_t *idx, int k, int64_t expert)
{
    for (int j = 0; j < k; j++)
        if (idx[j] == expert)
            return j;
    return -1;
}

/* Cast one token row as the contract says; scales [hidden/128]. */
static void cast_row(const uint16_t *row, int64_t hidden, int round_scale, uint8_t *out,
                     float *scales)
{
    for (int64_t g = 0; g < hidden / 128; g++) {
        float amax = 0.0f;
        for (int i = 0; i < 128; i++) {
            float v = fabsf(moe_bf16_to_float(row[g * 128 + i]));
            if (v > amax)
                amax = v;
        }
        if (amax < 1e-4f)
            amax = 1e-4f;
        float scale, multiplier;
        if (round_scale) {
            float target = amax / 448.0f;
            float p = 1.0f;
            while (p < target)
                p *= 2.0f;
            while (p / 2.0f >= target)
                p /= 2.0f;
            scale = p;
            multiplier = 1.0f / p;
        } else {
            scale = amax / 448.0f;
            multiplier = 448.0f / amax;
        }
        scales[g] = scale;
        for (int i = 0; i < 128; i++)
            out[g * 128 + i] = moe_ll_to_e4m3(moe_bf16_to_float(row[g * 128 + i]) * multiplier);
    }
}

int moe_ll_oracle_dispatch(const moe_case_t *c, int rank, int64_t max_tokens, const uint8_t *mask,
                           moe_ll_cast_t cast, moe_ll_expected_t *e)
{
    memset(e, 0, sizeof(*e));
    int world = c->world_size, k = c->num_topk;
    int num_local = c->num_experts / world;
    int64_t hidden = c->hidden, rows = max_tokens * world;
    size_t element = cast.use_fp8 ? 1 : 2;
    int64_t scale_cols = hidden / 128;
    e->num_local = num_local;
    e->rows = rows;
    e->count = calloc((size_t)num_local, sizeof(int32_t));
    e->src_rank = calloc((size_t)(num_local * rows) + 1, sizeof(int32_t));
    e->src_token = calloc((size_t)(num_local * rows) + 1, sizeof(int32_t));
    e->x = calloc((size_t)(num_local * rows * hidden) + 1, element);
    e->scales = calloc((size_t)(num_local * rows * scale_cols) + 1, sizeof(float));
    e->range = calloc((size_t)(num_local * world), sizeof(int64_t));
    uint8_t *fp8 = malloc((size_t)hidden);
    float *row_scales = malloc((size_t)(scale_cols + 1) * sizeof(float));
    if (!e->count || !e->src_rank || !e->src_token || !e->x || !e->scales || !e->range || !fp8 ||
        !row_scales) {
        free(fp8);
        free(row_scales);
        moe_ll_expected_free(e);
        return -1;
    }
    /* This rank's own pairs that a mask removes. */
    moe_inputs_t mine;
    if (moe_ll_inputs_make(c, rank, &mine) != 0)
        return -1;
    for (int64_t t = 0; t < mine.num_tokens; t++) {
        const int64_t *idx = mine.topk_idx + t * k;
        for (int j = 0; j < k; j++)
            if (idx[j] >= 0 && first_position(idx, k, idx[j]) == j && mask != NULL &&
                mask[idx[j] / num_local])
                e->masked_entries++;
    }
    moe_inputs_free(&mine);

    for (int src = 0; src < world; src++) {
        if (mask != NULL && mask[src]) {
            /* Nothing from a masked source: an empty range where its rows would start. */
            for (int local = 0; local < num_local; local++)
                e->range[local * world + src] = (int64_t)((uint64_t)e->count[local] << 32);
            continue;
        }
        moe_inputs_t in;
        if (moe_ll_inputs_make(c, src, &in) != 0)
            return -1;
        for (int local = 0; local < num_local; local++) {
            int64_t expert = (int64_t)rank * num_local + local;
            int64_t begin = e->count[local];
            for (int64_t t = 0; t < in.num_tokens; t++) {
                const int64_t *idx = in.topk_idx + t * k;
                if (first_position(idx, k, expert) < 0)
                    continue;
                int64_t row = local * rows + e->count[local]++;
                e->src_rank[row] = src;
                e->src_token[row] = (int32_t)t;
                const uint16_t *x = (const uint16_t *)in.x + t * hidden;
                if (cast.use_fp8) {
                    cast_row(x, hidden, cast.round_scale, fp8, row_scales);
                    memcpy((uint8_t *)e->x + row * hidden, fp8, (size_t)hidden);
                    memcpy(e->scales + row * scale_cols, row_scales,
                           (size_t)scale_cols * sizeof(float));
                } else {
                    memcpy((uint16_t *)e->x + row * hidden, x, (size_t)hidden * 2);
                }
            }
            e->range[local * world + src] =
                (int64_t)(((uint64_t)begin << 32) | (uint64_t)(e->count[local] - begin));
        }
        moe_inputs_free(&in);
    }
    free(fp8);
    free(row_scales);
    return 0;
}

void moe_ll_expected_free(moe_ll_expected_t *e)
{
    free(e->count);
    free(e->src_rank);
    free(e->src_token);
    free(e->x);
    free(e->scales);
    free(e->range);
    memset(e, 0, sizeof(*e));
}

void moe_ll_expert_row(const moe_case_t *c, int64_t expert, int src_rank, int64_t src_token,
                       uint16_t *row)
{
    /* moe_combine_row folds its second argument into the stream: one row per expert. */
    moe_combine_row(c, (int)expert, src_rank, src_token, row);
}

int moe_ll_oracle_combine(const moe_case_t *c, int rank, const uint8_t *mask, uint16_t **out,
                          int64_t *masked)
{
    int k = c->num_topk, num_local = c->num_experts / c->world_size;
    int64_t hidden = c->hidden;
    moe_inputs_t in;
    if (moe_ll_inputs_make(c, rank, &in) != 0)
        return -1;
    uint16_t *result = calloc((size_t)(in.num_tokens * hidden) + 1, 2);
    float *sum = malloc((size_t)hidden * sizeof(float));
    uint16_t *row = malloc((size_t)hidden * 2);
    if (result == NULL || sum == NULL || row == NULL)
        return -1;
    *masked = 0;
    for (int64_t t = 0; t < in.num_tokens; t++) {
        for (int64_t h = 0; h < hidden; h++)
            sum[h] = 0.0f;
        for (int j = 0; j < k; j++) {
            int64_t expert = in.topk_idx[t * k + j];
            if (expert < 0)
                continue;
            if (mask != NULL && mask[expert / num_local]) {
                (*masked)++;
                continue;
            }
            moe_ll_expert_row(c, expert, rank, t, row);
            float w = in.topk_weights[t * k + j];
            for (int64_t h = 0; h < hidden; h++)
                sum[h] = fmaf(w, moe_bf16_to_float(row[h]), sum[h]); /* one rounding */
        }
        for (int64_t h = 0; h < hidden; h++)
            result[t * hidden + h] = moe_float_to_bf16(sum[h]);
    }
    free(sum);
    free(row);
    moe_inputs_free(&in);
    *out = result;
    return 0;
}
