/*
 * The expected traffic across nodes that `epx bench --ranks-per-node` prints
 * (tools/bench/bench_nodes.c), on a routing small enough to count by hand: 4 ranks in 2 nodes
 * {0, 1} {2, 3}, 8 experts (rank r holds experts 2r and 2r + 1), top-3, hidden 256; and
 * the lines of the internode plan (memory, warps).
 */
#include <stdio.h>
#include <string.h>

#include "bench_nodes.h"
#include "test_util.h"

/*
 * Rank 0 (node 0):                                   records  home rows  forwarded
 *   t0 {0, 1, -1}  ranks 0            home only            0          1          0
 *   t1 {4, 6, 2}   ranks 2, 3 | 1     node 1 + home        1          1          2
 *   t2 {5, 7, 4}   ranks 2, 3 (2 twice)                    1          0          2
 *   t3 {-1 x 3}    nowhere                                 0          0          0
 *   t4 {3, 2, 0}   ranks 1, 0         home only            0          2          0
 * Rank 3 (node 1):
 *   t0 {0, 7, 2}   ranks 0, 1 | 3                          1          1          2
 *   t1 {6, 1, 5}   ranks 0 | 3, 2                          1          2          1
 */
static const int64_t rank0_idx[5 * 3] = {0, 1, -1, 4, 6, 2, 5, 7, 4, -1, -1, -1, 3, 2, 0};
static const int64_t rank3_idx[2 * 3] = {0, 7, 2, 6, 1, 5};

static epx__bench_nodes_shape_t shape_of(int per_node, epx_dtype_t dtype)
{
    epx__bench_nodes_shape_t shape = {4, per_node, 8, 3, 256, dtype};
    return shape;
}

static void check_counts(void)
{
    epx__bench_nodes_shape_t two_nodes = shape_of(2, EPX_DTYPE_BF16);
    epx__bench_nodes_counts_t c;
    CHECK_EQ_INT(epx__bench_nodes_count(&two_nodes, 0, rank0_idx, 5, &c), 0);
    CHECK_EQ_INT(c.tokens, 5);
    CHECK_EQ_INT(c.records, 2);
    CHECK_EQ_INT(c.home_rows, 4);
    CHECK_EQ_INT(c.forwarded_rows, 4);
    CHECK_EQ_INT(epx__bench_nodes_count(&two_nodes, 3, rank3_idx, 2, &c), 0);
    CHECK_EQ_INT(c.records, 2);
    CHECK_EQ_INT(c.home_rows, 3);
    CHECK_EQ_INT(c.forwarded_rows, 3);

    /* One node: nothing crosses the network, every row is local. */
    epx__bench_nodes_shape_t one_node = shape_of(4, EPX_DTYPE_BF16);
    CHECK_EQ_INT(epx__bench_nodes_count(&one_node, 0, rank0_idx, 5, &c), 0);
    CHECK_EQ_INT(c.records, 0);
    CHECK_EQ_INT(c.home_rows, 8);
    CHECK_EQ_INT(c.forwarded_rows, 0);
    /* Nodes of one rank: one record per destination rank other than the home rank. */
    epx__bench_nodes_shape_t per_rank = shape_of(1, EPX_DTYPE_BF16);
    CHECK_EQ_INT(epx__bench_nodes_count(&per_rank, 0, rank0_idx, 5, &c), 0);
    CHECK_EQ_INT(c.records, 3 + 2 + 1);
    CHECK_EQ_INT(c.home_rows, 2);
    CHECK_EQ_INT(c.forwarded_rows, 6);

    /* Ids outside [-1, 8) and shapes that do not hold together are refused. */
    const int64_t bad_high[3] = {0, 8, 1}, bad_low[3] = {-2, 0, 1};
    CHECK_EQ_INT(epx__bench_nodes_count(&two_nodes, 0, bad_high, 1, &c), -1);
    CHECK_EQ_INT(epx__bench_nodes_count(&two_nodes, 0, bad_low, 1, &c), -1);
    CHECK_EQ_INT(c.records, 0);
    epx__bench_nodes_shape_t uneven = shape_of(3, EPX_DTYPE_BF16);
    CHECK_EQ_INT(epx__bench_nodes_count(&uneven, 0, rank0_idx, 5, &c), -1);
    CHECK_EQ_INT(epx__bench_nodes_count(&two_nodes, 4, rank0_idx, 5, &c), -1);
}

static void check_sizes(void)
{
    epx__bench_nodes_shape_t bf16 = shape_of(2, EPX_DTYPE_BF16);
    epx__bench_nodes_shape_t fp8 = shape_of(2, EPX_DTYPE_FP8_E4M3);
    epx__bench_nodes_sizes_t s = epx__bench_nodes_sizes(&bf16, EPX__BENCH_NODES_DISPATCH);
    CHECK_EQ_INT(s.payload, 256 * 2);
    CHECK_EQ_INT(s.overhead, 3 * 8 + 3 * 4 + 2 * 4); /* ids, weights, rows on 2 ranks */
    CHECK_EQ_INT(s.local_row, 512);
    s = epx__bench_nodes_sizes(&fp8, EPX__BENCH_NODES_DISPATCH);
    CHECK_EQ_INT(s.payload, 256 + 2 * 4); /* fp8 row + one fp32 scale per 128 */
    CHECK_EQ_INT(s.overhead, 44);
    CHECK_EQ_INT(s.local_row, 264);
    s = epx__bench_nodes_sizes(&fp8, EPX__BENCH_NODES_COMBINE);
    CHECK_EQ_INT(s.payload, 512); /* one bf16 partial row, whatever was dispatched */
    CHECK_EQ_INT(s.overhead, 3 * 4);
    CHECK_EQ_INT(s.local_row, 512);
}

/* What print_row writes for `row`, in `text`. */
static void print_to(const epx__bench_nodes_shape_t *shape, const epx__bench_nodes_row_t *row,
                     int json, char *text, size_t size)
{
    FILE *file = tmpfile();
    CHECK(file != NULL);
    epx__bench_nodes_print_row(file, shape, row, json);
    rewind(file);
    size_t got = fread(text, 1, size - 1, file);
    text[got] = '\0';
    fclose(file);
}

static void check_report(void)
{
    epx__bench_nodes_shape_t shape = shape_of(2, EPX_DTYPE_BF16);
    epx__bench_nodes_counts_t rank0, rank3;
    CHECK_EQ_INT(epx__bench_nodes_count(&shape, 0, rank0_idx, 5, &rank0), 0);
    CHECK_EQ_INT(epx__bench_nodes_count(&shape, 3, rank3_idx, 2, &rank3), 0);
    /* Ranks 1 and 2 send nothing: the totals are ranks 0 and 3. */
    epx__bench_nodes_counts_t total = {7, 4, 7, 7};
    epx__bench_nodes_row_t dispatch = {EPX__BENCH_NODES_DISPATCH, EPX_DTYPE_BF16,
                                       epx__bench_nodes_sizes(&shape, EPX__BENCH_NODES_DISPATCH),
                                       rank0, total};
    epx__bench_nodes_row_t combine = {EPX__BENCH_NODES_COMBINE, EPX_DTYPE_BF16,
                                      epx__bench_nodes_sizes(&shape, EPX__BENCH_NODES_COMBINE),
                                      rank0, total};
    CHECK_EQ_INT(epx__bench_nodes_network_bytes(&dispatch, &rank0), 2 * (512 + 44));
    CHECK_EQ_INT(epx__bench_nodes_network_bytes(&dispatch, &total), 4 * 556);
    CHECK_EQ_INT(epx__bench_nodes_local_bytes(&dispatch, &rank0), 8 * 512);
    CHECK_EQ_INT(epx__bench_nodes_network_bytes(&combine, &total), 4 * (512 + 12));
    CHECK_EQ_INT(epx__bench_nodes_local_bytes(&combine, &total), 14 * 512);

    char text[2048];
    print_to(&shape, &dispatch, 1, text, sizeof text);
    static const char *const dispatch_json[] = {
        "\"traffic\":\"expected\"", "\"ranks\":4,\"ranks_per_node\":2,\"nodes\":2",
        "\"traffic_op\":\"dispatch\"", "\"tokens_total\":7", "\"records_rank0\":2",
        "\"records_total\":4", "\"payload_bytes_per_record\":512",
        "\"overhead_bytes_per_record\":44", "\"network_bytes_per_rank\":1112",
        "\"network_bytes_total\":2224", "\"local_bytes_per_rank\":4096",
        "\"local_bytes_total\":7168", "\"network_bytes_per_token\":317.714",
        "\"network_payload_bytes_per_token\":292.571",
        "\"network_overhead_bytes_per_token\":25.1429",
        "\"network_messages_per_token\":0.571429", "\"local_bytes_per_token\":1024}"};
    for (size_t i = 0; i < sizeof dispatch_json / sizeof dispatch_json[0]; i++)
        if (strstr(text, dispatch_json[i]) == NULL)
            TEST_FAIL("dispatch JSON lacks %s: %s", dispatch_json[i], text);
    CHECK(strstr(text, "\"op\"") == NULL); /* not a timed row (epx doctor reads "op") */

    print_to(&shape, &combine, 0, text, sizeof text);
    /* dtype, op, net per rank, per token, payload, overhead, messages, local per rank, per token */
    if (strstr(text, "  bf16  combine            1048        299.4       292.6         6.9"
                     "      0.571          4096       1024.0") == NULL)
        TEST_FAIL("combine table row: '%s'", text);

    /* No tokens at all: per-token figures are "-" / null, not a division by zero. */
    epx__bench_nodes_counts_t none = {0, 0, 0, 0};
    epx__bench_nodes_row_t empty = {EPX__BENCH_NODES_COMBINE, EPX_DTYPE_BF16,
                                    combine.sizes, none, none};
    print_to(&shape, &empty, 1, text, sizeof text);
    CHECK(strstr(text, "\"network_bytes_per_token\":null") != NULL);
}

/* What print_plan writes for `plan`, in `text`. */
static void print_plan_to(const epx_internode_plan_t *plan, int json, char *text, size_t size)
{
    FILE *file = tmpfile();
    CHECK(file != NULL);
    epx__bench_nodes_print_plan(file, plan, json);
    rewind(file);
    size_t got = fread(text, 1, size - 1, file);
    text[got] = '\0';
    fclose(file);
}

/* The internode plan lines: memory and the warp split, worst case and rings. */
static void check_plan(void)
{
    epx_internode_plan_t plan = EPX_INTERNODE_PLAN_INIT;
    plan.num_nodes = 2;
    plan.slots_per_channel = 4096;
    plan.record_bytes = 14688;
    plan.partial_bytes = 14368;
    plan.record_slot_bytes = 240648192;
    plan.partial_slot_bytes = 235405312;
    plan.bytes_per_rank = (size_t)3 << 30;
    plan.puts_in_flight = 256;
    plan.num_sms = 16;
    plan.sender_warps = 256;
    plan.receiver_warps = 256;
    char text[2048];
    print_plan_to(&plan, 0, text, sizeof text);
    static const char *const worst[] = {
        "# internode memory per rank: 3.00 GiB", "record slots 229.50 MiB",
        "partial-sum slots 224.50 MiB", "4096 tokens per (rank, node) channel, the worst case, "
        "no credits", "(16 SMs): all 256 send, then forward", "256 puts in flight per peer"};
    for (size_t i = 0; i < sizeof worst / sizeof worst[0]; i++)
        if (strstr(text, worst[i]) == NULL)
            TEST_FAIL("plan text lacks '%s': %s", worst[i], text);

    plan.credits = 1;
    plan.slots_per_channel = 16;
    plan.chunk_tokens = 4;
    plan.sender_warps = 127;
    plan.receiver_warps = 128;
    plan.credit_warps = 1;
    plan.puts_in_flight = 16;
    print_plan_to(&plan, 0, text, sizeof text);
    static const char *const ring[] = {
        "rings of 16 tokens per (rank, node) channel (EPX_XN_RING_TOKENS), chunks of 4, "
        "credits back", "127 senders, 128 receivers", "1 credit warp",
        "16 puts in flight per peer"};
    for (size_t i = 0; i < sizeof ring / sizeof ring[0]; i++)
        if (strstr(text, ring[i]) == NULL)
            TEST_FAIL("plan text lacks '%s': %s", ring[i], text);
    print_plan_to(&plan, 1, text, sizeof text);
    static const char *const json[] = {
        "{\"mode\":\"normal\",\"internode_plan\":true,\"nodes\":2,\"credits\":1",
        "\"slots_per_channel\":16,\"chunk_tokens\":4", "\"record_slot_bytes\":240648192",
        "\"buffer_bytes_per_rank\":3221225472", "\"sender_warps\":127,\"receiver_warps\":128,"
        "\"credit_warps\":1,\"puts_in_flight\":16}\n"};
    for (size_t i = 0; i < sizeof json / sizeof json[0]; i++)
        if (strstr(text, json[i]) == NULL)
            TEST_FAIL("plan JSON lacks %s: %s", json[i], text);
    CHECK(strstr(text, "\"op\"") == NULL); /* not a timed row */
}

int main(void)
{
    check_counts();
    check_sizes();
    check_report();
    check_plan();
    printf("test_bench_nodes: ok\n");
    return 0;
}
