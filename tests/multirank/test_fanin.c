/*
 * epx_fanin_reduce (include/epx_tool.h) on every rank of a launched group, every output
 * element checked bit for bit against a reference this program computes itself (fp32
 * sums in the header's order, rounded to bf16 by its own rounding, not the library's).
 *
 *   epx launch -n N -- test_fanin [--backend host|cuda|auto] [--seed S]
 *
 * For fanin 1, a fractional fanin (5.25 where there are 6 ranks or more, else R - 0.75)
 * and R:
 *   round trip  random bf16 rows fanned out with epx_fanout_copy, then fanned back in:
 *               row i comes back as k_i copies of itself added up; every region first
 *               holds other random rows, so a row read from a rank the fan-out did not
 *               write to shows;
 *   sources     every rank fills its own combine-input region with rows of its own, and
 *               the sums read them back: which rank each term comes from and the order
 *               of the adds both show (the program checks that the reverse order would
 *               give other bits somewhere when a row has 3 terms or more), on part of a
 *               row, into rows of a wider pitch whose other bytes must stay untouched,
 *               on one SM and on several.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "epx_tool.h"
#include "harness.h"
#include "mem.h"
#include "moe_case.h"
#include "test_util.h"

/* max_tokens_per_rank: more rows than 16 blocks of 16 warps, so at 16 SMs (the 8 x 2
 * loads form) rows pass by ticket between blocks as well as at 1 SM (the 6 x 3 form). */
#define FI_TOKENS 448
/* 205 vectors of 16 bytes: several batches of 32 lanes x 2 or 3 vectors a row, the last
 * ending part-way. */
#define FI_HIDDEN 1640
#define FI_ROW_BYTES (FI_HIDDEN * 2)
#define FI_UNTOUCHED 0xee

static epx_group_t group;
static epx_group_info_t info = EPX_GROUP_INFO_INIT;
static uint64_t seed = 7;

/* ---------------------------------------------------------------- the reference */

/*
 * A random bf16 value, a pure function of its coordinates, with a random sign and now
 * and then -0.0 (a sum from 0.0f makes it +0.0). Even elements: any mantissa, exponent
 * within 2^-12 .. 2^12 (rounding of every kind). Odd elements: 1 or 1.5 times 2^-16, 2^0,
 * 2^8 or 2^16, so that terms often cancel exactly after a small one was lost in fp32
 * beside them (the order of the adds shows: 2^16 + 2^-16 - 2^16 is 0, 2^16 - 2^16 +
 * 2^-16 is not), and 2^8 + 1 = 257 is a tie that rounds to even.
 */
static uint16_t random_bf16(uint64_t stream, uint64_t rank, uint64_t row, uint64_t element)
{
    static const int coarse_exponents[] = {-16, 0, 8, 16};
    uint64_t w = moe_splitmix64(seed);
    w = moe_splitmix64(w ^ stream);
    w = moe_splitmix64(w ^ rank);
    w = moe_splitmix64(w ^ row);
    w = moe_splitmix64(w ^ element);
    if ((w & 63) == 0)
        return 0x8000;
    uint16_t sign = (uint16_t)(((w >> 8) & 1) << 15);
    uint16_t exponent, mantissa;
    if (element % 2 == 0) {
        exponent = (uint16_t)(127 - 12 + (int)((w >> 16) % 25));
        mantissa = (uint16_t)((w >> 32) & 0x7f);
    } else {
        exponent = (uint16_t)(127 + coarse_exponents[(w >> 16) & 3]);
        mantissa = (w >> 32) & 1 ? 0x40 : 0;
    }
    return (uint16_t)(sign | exponent << 7 | mantissa);
}

static float bf16_value(uint16_t bits)
{
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof(value));
    return value;
}

/* An fp32 value rounded to bf16 (8 significant bits, ties to even), computed through
 * frexp and rint rather than the library's bit trick. Finite values of normal range
 * only: the sums here are 0 or within 2^-19 .. 2^20. */
static uint16_t round_to_bf16(float value)
{
    int exponent = 0;
    float fraction = frexpf(value, &exponent); /* 0.5 <= |fraction| < 1, or 0 */
    float rounded = ldexpf(rintf(ldexpf(fraction, 8)), exponent - 8);
    uint32_t bits;
    memcpy(&bits, &rounded, sizeof(bits));
    if ((bits & 0xffffu) != 0)
        TEST_FAIL("reference: %a rounded to %a, which is not a bf16", (double)value,
                  (double)rounded);
    return (uint16_t)(bits >> 16);
}

static int count_of(int64_t row, double fanin)
{
    int64_t milli = (int64_t)(fanin * 1000.0 + 0.5);
    return (int)((row + 1) * milli / 1000 - row * milli / 1000);
}

/* ---------------------------------------------------------------- one call */

typedef struct {
    const char *name;
    double fanin;
    int64_t rows;
    int64_t row_bytes;
    int64_t dst_pitch; /* 0 = row_bytes */
    int num_sms;
} fanin_case_t;

/* Run the sum into a fresh output (FI_UNTOUCHED bytes), bracketed like the bench does:
 * every rank's inputs in place before, no rank refills a region before all are done. */
static uint8_t *run_fanin(epx_buffer_t buffer, const fanin_case_t *c, size_t out_bytes)
{
    void *dst = mr_mem_alloc(out_bytes, FI_UNTOUCHED);
    epx_fanin_args_t args = EPX_FANIN_ARGS_INIT;
    args.dst = dst;
    args.dst_pitch = c->dst_pitch;
    args.rows = c->rows;
    args.row_bytes = c->row_bytes;
    args.fanin = c->fanin;
    args.num_sms = c->num_sms;
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_fanin_reduce(buffer, &args, NULL));
    mr_mem_sync();
    CHECK_OK(epx_group_barrier(group));
    uint8_t *out = malloc(out_bytes);
    CHECK(out != NULL);
    mr_mem_to_host(out, dst, out_bytes);
    mr_mem_free(dst);
    return out;
}

/* The element of a row: which rank holds the term j of row i, and its value. */
typedef uint16_t (*term_fn)(int64_t row, int j, int64_t element);

static uint16_t round_trip_term(int64_t row, int j, int64_t element)
{
    (void)j;
    return random_bf16(0, (uint64_t)info.rank, (uint64_t)row, (uint64_t)element);
}

static uint64_t sources_stream = 2;

static uint16_t sources_term(int64_t row, int j, int64_t element)
{
    const int holder = (int)((info.rank + row + j) % info.world_size);
    const int64_t region_row = (int64_t)info.rank * FI_TOKENS + row;
    return random_bf16(sources_stream, (uint64_t)holder, (uint64_t)region_row,
                       (uint64_t)element);
}

/* Every byte of `out` against the reference: each row's sums, then FI_UNTOUCHED past
 * row_bytes in its pitch and in every row past `rows`. Returns the elements where the
 * sums added in reverse order round to other bits. */
static int64_t check_output(const fanin_case_t *c, const uint8_t *out, size_t out_bytes,
                            term_fn term)
{
    const int64_t pitch = c->dst_pitch != 0 ? c->dst_pitch : c->row_bytes;
    int64_t reversed_differs = 0;
    for (size_t at = 0; at < out_bytes; at++) {
        const int64_t row = (int64_t)at / pitch, byte = (int64_t)at % pitch;
        if (row < c->rows && byte < c->row_bytes)
            continue;
        if (out[at] != FI_UNTOUCHED)
            TEST_FAIL("rank %d: %s, fanin %.2f: byte %lld of row %lld is 0x%02x, expected "
                      "0x%02x (not part of the sums)",
                      info.rank, c->name, c->fanin, (long long)byte, (long long)row, out[at],
                      FI_UNTOUCHED);
    }
    for (int64_t i = 0; i < c->rows; i++) {
        const int k = count_of(i, c->fanin);
        for (int64_t e = 0; e < c->row_bytes / 2; e++) {
            float sum = 0.0f, backwards = 0.0f;
            for (int j = 0; j < k; j++)
                sum += bf16_value(term(i, j, e));
            for (int j = k - 1; j >= 0; j--)
                backwards += bf16_value(term(i, j, e));
            const uint16_t want = round_to_bf16(sum);
            uint16_t got;
            memcpy(&got, out + i * pitch + e * 2, sizeof(got));
            if (got != want)
                TEST_FAIL("rank %d: %s, fanin %.2f: row %lld (%d terms), element %lld is "
                          "0x%04x, expected 0x%04x",
                          info.rank, c->name, c->fanin, (long long)i, k, (long long)e, got,
                          want);
            reversed_differs += round_to_bf16(backwards) != want;
        }
    }
    return reversed_differs;
}

/* ---------------------------------------------------------------- the cases */

/* This rank's combine-input region (R x FI_TOKENS rows): the view of a dispatch that
 * sends every token to every rank. The handle stays alive while the region is used. */
static epx_tensor_t region_of(epx_buffer_t buffer, epx_handle_t *handle, void **inputs)
{
    const int R = info.world_size;
    int64_t *idx = malloc((size_t)FI_TOKENS * (size_t)R * sizeof(int64_t));
    CHECK(idx != NULL);
    for (int t = 0; t < FI_TOKENS; t++)
        for (int j = 0; j < R; j++)
            idx[t * R + j] = j;
    inputs[0] = mr_mem_alloc((size_t)FI_TOKENS * FI_ROW_BYTES, 0);
    inputs[1] = mr_mem_from_host(idx, (size_t)FI_TOKENS * (size_t)R * sizeof(int64_t));
    free(idx);
    epx_dispatch_args_t dispatch = EPX_DISPATCH_ARGS_INIT;
    dispatch.x = epx_tensor_2d(inputs[0], EPX_DTYPE_BF16, FI_TOKENS, FI_HIDDEN);
    dispatch.topk_idx = epx_tensor_2d(inputs[1], EPX_DTYPE_INT64, FI_TOKENS, R);
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &dispatch, &result, NULL));
    epx_tensor_t region = EPX_TENSOR_NONE;
    CHECK_OK(epx_get_combine_input(buffer, result.handle, &region));
    CHECK_EQ_INT(region.shape[0], (int64_t)R * FI_TOKENS);
    CHECK_EQ_INT(region.shape[1], FI_HIDDEN);
    *handle = result.handle;
    return region;
}

/* Fill this rank's whole region with random rows of `stream` (rank-keyed). */
static void fill_region(const epx_tensor_t *region, uint64_t stream)
{
    const int64_t rows = (int64_t)info.world_size * FI_TOKENS;
    uint16_t *host = malloc((size_t)rows * FI_ROW_BYTES);
    CHECK(host != NULL);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t e = 0; e < FI_HIDDEN; e++)
            host[r * FI_HIDDEN + e] = random_bf16(stream, (uint64_t)info.rank, (uint64_t)r,
                                                  (uint64_t)e);
    mr_mem_to_device(region->data, host, (size_t)rows * FI_ROW_BYTES);
    mr_mem_sync();
    free(host);
}

/* Random rows fanned out, then fanned back in over regions that held other rows. */
static void run_round_trip(epx_buffer_t buffer, const epx_tensor_t *region, double fanin)
{
    fill_region(region, 1);
    uint16_t *rows = malloc((size_t)FI_TOKENS * FI_ROW_BYTES);
    CHECK(rows != NULL);
    for (int64_t i = 0; i < FI_TOKENS; i++)
        for (int64_t e = 0; e < FI_HIDDEN; e++)
            rows[i * FI_HIDDEN + e] = round_trip_term(i, 0, e);
    void *src = mr_mem_from_host(rows, (size_t)FI_TOKENS * FI_ROW_BYTES);
    free(rows);
    epx_fanout_args_t out = EPX_FANOUT_ARGS_INIT;
    out.src = src;
    out.rows = FI_TOKENS;
    out.row_bytes = FI_ROW_BYTES;
    out.fanout = fanin;
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_fanout_copy(buffer, &out, NULL));
    mr_mem_sync();

    const fanin_case_t c = {"round trip", fanin, FI_TOKENS, FI_ROW_BYTES, 0, 16};
    const size_t out_bytes = (size_t)FI_TOKENS * FI_ROW_BYTES;
    uint8_t *sums = run_fanin(buffer, &c, out_bytes);
    check_output(&c, sums, out_bytes, round_trip_term);
    printf("rank %d: fanin %.2f round trip: %d rows of %d bytes, each its k copies added up\n",
           info.rank, fanin, FI_TOKENS, FI_ROW_BYTES);
    free(sums);
    mr_mem_free(src);
}

/* Each rank's own rows in its region, summed back; part of a row, a wider pitch, fewer
 * rows than the region has, on `num_sms` SMs. */
static void run_sources(epx_buffer_t buffer, const epx_tensor_t *region, double fanin,
                        int num_sms)
{
    sources_stream++;
    fill_region(region, sources_stream);
    const fanin_case_t c = {"sources", fanin, FI_TOKENS - 3, 336, 352, num_sms};
    const size_t out_bytes = (size_t)FI_TOKENS * 352;
    uint8_t *sums = run_fanin(buffer, &c, out_bytes);
    const int64_t reversed_differs = check_output(&c, sums, out_bytes, sources_term);
    int most = 0;
    for (int64_t i = 0; i < c.rows; i++)
        most = count_of(i, fanin) > most ? count_of(i, fanin) : most;
    /* With three terms or more the order of the adds matters: a sum that ignored it
     * would have been caught, if the values can tell. */
    if (most >= 3 && reversed_differs == 0)
        TEST_FAIL("rank %d: fanin %.2f: the sums in reverse order round the same everywhere, "
                  "so the check cannot tell the order (pick other values)",
                  info.rank, fanin);
    char budget[32];
    snprintf(budget, sizeof(budget), num_sms > 0 ? "%d SMs" : "the buffer's SMs", num_sms);
    printf("rank %d: fanin %.2f sources on %s: %lld rows of %lld bytes from the right "
           "ranks, in order (%lld elements would differ in reverse)\n",
           info.rank, fanin, budget, (long long)c.rows, (long long)c.row_bytes,
           (long long)reversed_differs);
    free(sums);
}

int main(int argc, char **argv)
{
    /* A hang is a failure too: the alarm ends the program well inside the test timeout. */
    alarm(100);
    group = mr_group_create(argc, argv, &info);
    seed = strtoull(mr_flag(argc, argv, "--seed", "7"), NULL, 10);
    const int R = info.world_size;
    if (info.ranks_per_node < R)
        TEST_FAIL("test_fanin needs every rank on one node (the sum is refused across nodes)");

    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = FI_TOKENS;
    config.hidden = FI_HIDDEN;
    config.num_experts = R;
    config.num_topk = R;
    epx_buffer_t buffer = NULL;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    epx_handle_t handle = NULL;
    void *inputs[2] = {NULL, NULL};
    const epx_tensor_t region = region_of(buffer, &handle, inputs);
    /* The dispatch's own writes into the regions are done everywhere before any fill. */
    mr_mem_sync();
    CHECK_OK(epx_group_barrier(group));

    const double fanins[] = {1.0, R >= 6 ? 5.25 : R - 0.75, (double)R};
    for (int f = 0; f < 3; f++) {
        if (fanins[f] < 1.0)
            continue;
        run_round_trip(buffer, &region, fanins[f]);
        run_sources(buffer, &region, fanins[f], 1);
        run_sources(buffer, &region, fanins[f], 0);
    }

    CHECK_OK(epx_handle_destroy(handle));
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(inputs[0]);
    mr_mem_free(inputs[1]);
    CHECK_OK(epx_group_destroy(group));
    printf("test_fanin: ok (rank %d of %d)\n", info.rank, R);
    return 0;
}
