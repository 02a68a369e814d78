/*
 * The pieces of `epx bench` that decide PASS/FAIL and the numbers printed: exact and
 * one-ulp comparisons (and the row/column they report), median, p99 and mean, the floor.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "bench_ll.h"
#include "bench_report.h"
#include "test_util.h"

static char captured[4096];

/* Run a comparison with stderr sent to a file, keep what it printed in `captured`. */
#define CAPTURE(result, call)                                        \
    do {                                                             \
        fflush(stderr);                                              \
        FILE *capture_file_ = tmpfile();                             \
        CHECK(capture_file_ != NULL);                                \
        int saved_fd_ = dup(2);                                      \
        dup2(fileno(capture_file_), 2);                              \
        (result) = (call);                                           \
        fflush(stderr);                                              \
        dup2(saved_fd_, 2);                                          \
        close(saved_fd_);                                            \
        rewind(capture_file_);                                       \
        size_t got_ = fread(captured, 1, sizeof(captured) - 1, capture_file_); \
        captured[got_] = '\0';                                       \
        fclose(capture_file_);                                       \
    } while (0)

static void test_exact_compare(void)
{
    int64_t expected[6] = {1, 2, 3, 4, 5, 6};
    int64_t got[6] = {1, 2, 3, 4, 5, 6};
    int ok;
    CAPTURE(ok, epx__bench_compare("rank 1 bf16", "recv_topk_idx", EPX_DTYPE_INT64, got,
                                   expected, 2, 3));
    CHECK_EQ_INT(ok, 1);
    CHECK_EQ_INT(strlen(captured), 0);

    got[5] = -1; /* row 1, column 2 */
    got[4] = 9;  /* row 1, column 1: the first difference */
    CAPTURE(ok, epx__bench_compare("rank 1 bf16", "recv_topk_idx", EPX_DTYPE_INT64, got,
                                   expected, 2, 3));
    CHECK_EQ_INT(ok, 0);
    CHECK(strstr(captured, "rank 1 bf16: recv_topk_idx differs at row 1 column 1: got 9, "
                           "expected 5") != NULL);

    /* Floats compare by bits: -0.0 is not 0.0 for an exact copy. */
    float expected_f[2] = {0.0f, 1.5f}, got_f[2] = {-0.0f, 1.5f};
    CAPTURE(ok, epx__bench_compare("r", "weights", EPX_DTYPE_FP32, got_f, expected_f, 1, 2));
    CHECK_EQ_INT(ok, 0);
    CHECK(strstr(captured, "row 0 column 0") != NULL);

    uint8_t expected_b[4] = {1, 0, 0, 1}, got_b[4] = {1, 0, 1, 1};
    CAPTURE(ok, epx__bench_compare("r", "is_token_in_rank", EPX_DTYPE_BOOL, got_b, expected_b,
                                   2, 2));
    CHECK_EQ_INT(ok, 0);
    CHECK(strstr(captured, "row 1 column 0: got 0x01, expected 0x00") != NULL);
}

static void test_bf16_ulp(void)
{
    /* 1.0 = 0x3f80; its neighbours 0x3f7f and 0x3f81 are one ulp away. */
    uint16_t expected[4] = {0x3f80, 0x3f80, 0x0000, 0xbf80};
    uint16_t got[4] = {0x3f81, 0x3f7f, 0x8000, 0xbf81};
    int ok;
    CAPTURE(ok, epx__bench_compare_bf16("r", "combine out_x", got, expected, 2, 2, 1));
    CHECK_EQ_INT(ok, 1);

    got[3] = 0xbf82; /* two ulps below -1.0 */
    CAPTURE(ok, epx__bench_compare_bf16("r", "combine out_x", got, expected, 2, 2, 1));
    CHECK_EQ_INT(ok, 0);
    CHECK(strstr(captured, "combine out_x differs at row 1 column 1") != NULL);

    /* The smallest positive and negative values straddle zero: two ulps apart. */
    uint16_t tiny_expected[1] = {0x0001}, tiny_got[1] = {0x8001};
    CAPTURE(ok, epx__bench_compare_bf16("r", "x", tiny_got, tiny_expected, 1, 1, 1));
    CHECK_EQ_INT(ok, 0);

    uint16_t nan_expected[1] = {0x7fc0}, nan_got[1] = {0x7fc0};
    CAPTURE(ok, epx__bench_compare_bf16("r", "x", nan_got, nan_expected, 1, 1, 1));
    CHECK_EQ_INT(ok, 0); /* NaN is never a correct sum */
}

static void test_statistics(void)
{
    double odd[3] = {3, 1, 2};
    CHECK(epx__bench_median(odd, 3) == 2);
    double even[4] = {4, 1, 3, 2};
    CHECK(epx__bench_median(even, 4) == 2.5);
    double hundred[100];
    for (int i = 0; i < 100; i++)
        hundred[i] = 100 - i; /* 100 .. 1 */
    CHECK(epx__bench_p99(hundred, 100) == 99);
    double three[3] = {5, 7, 6};
    CHECK(epx__bench_p99(three, 3) == 7);
    CHECK(isnan(epx__bench_median(three, 0)));
}

static void test_floor(void)
{
    /* Dispatch: source tokens read once, received rows written once; combine: received
     * rows read once, output rows (and per-token routing) written/read once. */
    CHECK(epx__bench_dispatch_floor_bytes(10, 100, 30, 90) == 10 * 100 + 30 * 90);
    CHECK(epx__bench_combine_floor_bytes(10, 12, 30, 200) == 30 * 200 + 10 * (200 + 12));
    /* The standard normal case, bf16: 8 x 4096 tokens of 14336 bytes; about 5.3 of the 8
     * ranks get each token. Its floor at 4250 GB/s is about 695 us. */
    int64_t received = 8 * 4096 * 53 / 10;
    int64_t bytes = epx__bench_dispatch_floor_bytes(8 * 4096, 14336, received, 14336);
    epx__bench_context_t context;
    memset(&context, 0, sizeof(context));
    context.floor_bw_gbps = 4250;
    epx__bench_row_t row;
    memset(&row, 0, sizeof(row));
    row.floor_bytes = bytes;
    double floor_us = epx__bench_floor_us(&context, &row);
    CHECK(floor_us > 680 && floor_us < 710);
    row.floor_bytes = 8500000000LL; /* 8.5 GB moved at 4250 GB/s: 2 ms */
    CHECK(fabs(epx__bench_floor_us(&context, &row) - 2000.0) < 1e-6);
    row.floor_bytes = 0; /* layout, the send and receive halves: no floor */
    CHECK(isnan(epx__bench_floor_us(&context, &row)));
    row.floor_bytes = 1000;
    context.floor_bw_gbps = 0;
    CHECK(isnan(epx__bench_floor_us(&context, &row)));
    /* floor/time: 1.0 at the floor, 0.5 at twice its time; unknown stays unknown. */
    CHECK(epx__bench_floor_over_time(100.0, 200.0) == 0.5);
    CHECK(epx__bench_floor_over_time(100.0, 100.0) == 1.0);
    CHECK(isnan(epx__bench_floor_over_time(NAN, 100.0)));
    CHECK(isnan(epx__bench_floor_over_time(100.0, 0.0)));
    CHECK(isnan(epx__bench_floor_over_time(100.0, NAN)));
}

/* Low-latency mode: mean, statistics that leave their input alone, the copy time. */
static void test_ll_statistics(void)
{
    double values[4] = {4, 1, 3, 2};
    CHECK(epx__bench_mean(values, 4) == 2.5);
    CHECK(isnan(epx__bench_mean(values, 0)));
    epx__bench_stats_t stats = epx__bench_stats(values, 4);
    CHECK(stats.median_us == 2.5 && stats.p99_us == 4 && stats.mean_us == 2.5);
    CHECK(values[0] == 4 && values[1] == 1); /* not sorted in place */
    stats = epx__bench_stats(values, 0);
    CHECK(isnan(stats.median_us) && isnan(stats.p99_us) && isnan(stats.mean_us));
    /* The standard low-latency case: 8 ranks x 1024 fp8 rows of 7392 B written and their
     * 128 bf16 tokens (+ 8 ids) read, at 4250 GB/s, is about 17.7 us (bench_ll.c). */
    int64_t dispatch = epx__bench_dispatch_floor_bytes(8 * 128, 7168 * 2 + 8 * 8, 8 * 1024, 7392);
    CHECK(fabs(epx__bench_copy_time_us(dispatch, 4250) - 17.7) < 0.05);
    CHECK(fabs(epx__bench_copy_time_us(2LL * 8 * 1024 * 7392, 4250) - 28.5) < 0.05);
    CHECK(isnan(epx__bench_copy_time_us(0, 4250)));
    CHECK(isnan(epx__bench_copy_time_us(1000, 0)));
    CHECK(strcmp(epx__bench_ll_op_name(EPX__BENCH_LL_COMBINE_RECV), "combine_recv") == 0);
    char text[32];
    epx__bench_format_bytes(512, text, sizeof(text));
    CHECK(strcmp(text, "512 B") == 0);
    epx__bench_format_bytes(3LL << 29, text, sizeof(text));
    CHECK(strcmp(text, "1.50 GiB") == 0);
}

int main(void)
{
    test_exact_compare();
    test_bf16_ulp();
    test_statistics();
    test_floor();
    test_ll_statistics();
    printf("PASS test_bench_helpers\n");
    return 0;
}
