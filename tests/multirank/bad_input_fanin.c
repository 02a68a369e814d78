/*
 * epx_fanin_reduce (include/epx_tool.h): every bad argument refused on the rank that
 * passed it, naming what is wrong, with no effect (the output rows keep their bytes);
 * then a valid call on the same buffer goes through. The sums themselves are checked by
 * test_fanin.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bad_input.h"
#include "epx_tool.h"
#include "mem.h"
#include "test_util.h"

#define FI_TOKENS 5                  /* max_tokens_per_rank of the buffer */
#define FI_ROW_BYTES (BI_HIDDEN * 2) /* a whole bf16 row */
#define FI_SUM_BYTES 256             /* bytes of each row the valid call sums (half a row) */
#define FI_UNTOUCHED 0xee

/* Bad case `i` applied to valid `a`: its name and the word the error must name; NULL past
 * the last case. */
static const char *break_args(int i, epx_fanin_args_t *a, void *dst, const char **culprit)
{
    const int R = bi_info.world_size;
    switch (i) {
    case 0: *culprit = "size"; a->size -= 8; return "fanin: wrong args.size";
    case 1: *culprit = "kernel"; a->kernel = (epx_fanin_kernel_t)2; return "fanin: kernel 2";
    case 2: *culprit = "dst"; a->dst = NULL; return "fanin: NULL dst";
    case 3: *culprit = "dst"; a->dst = (char *)dst + 8; return "fanin: dst off 16 bytes";
    case 4: *culprit = "rows"; a->rows = -1; return "fanin: rows -1";
    case 5: *culprit = "rows"; a->rows = FI_TOKENS + 1; return "fanin: rows past max_tokens";
    case 6: *culprit = "row_bytes"; a->row_bytes = 0; return "fanin: row_bytes 0";
    case 7: *culprit = "row_bytes"; a->row_bytes = 8; return "fanin: row_bytes 8";
    case 8: *culprit = "row_bytes"; a->row_bytes = FI_ROW_BYTES + 16; return "fanin: row_bytes past a row";
    case 9: *culprit = "dst_pitch"; a->dst_pitch = 128; return "fanin: dst_pitch below a row";
    case 10: *culprit = "dst_pitch"; a->dst_pitch = FI_SUM_BYTES + 8; return "fanin: dst_pitch off 16";
    case 11: *culprit = "fanin"; a->fanin = 0.5; return "fanin: fanin 0.5";
    case 12: *culprit = "fanin"; a->fanin = R + 1; return "fanin: fanin past the ranks";
    case 13: *culprit = "num_sms"; a->num_sms = -1; return "fanin: num_sms -1";
    case 14: *culprit = "num_sms"; a->num_sms = 2000; return "fanin: num_sms 2000";
    default: return NULL;
    }
}

/* The bytes of each output row from `from` on still FI_UNTOUCHED (0: every byte). */
static void expect_untouched(const void *dst, int from, const char *after)
{
    uint8_t host[FI_TOKENS * FI_ROW_BYTES];
    mr_mem_to_host(host, dst, sizeof(host));
    for (int row = 0; row < FI_TOKENS; row++)
        for (int b = from; b < FI_ROW_BYTES; b++)
            if (host[row * FI_ROW_BYTES + b] != FI_UNTOUCHED)
                TEST_FAIL("rank %d: %s: output row %d, byte %d is 0x%02x, expected 0x%02x "
                          "(untouched)",
                          bi_info.rank, after, row, b, host[row * FI_ROW_BYTES + b],
                          FI_UNTOUCHED);
}

void bi_run_fanin_cases(void)
{
    const int R = bi_info.world_size;
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = FI_TOKENS;
    config.hidden = BI_HIDDEN;
    config.num_experts = R;
    config.num_topk = 1;
    epx_buffer_t buffer = NULL;
    CHECK_OK(epx_buffer_create(bi_group, &config, &buffer));
    void *dst = mr_mem_alloc((size_t)FI_TOKENS * FI_ROW_BYTES, FI_UNTOUCHED);

    epx_fanin_args_t args = EPX_FANIN_ARGS_INIT;
    args.dst = dst;
    args.rows = FI_TOKENS;
    args.row_bytes = FI_SUM_BYTES;
    bi_expect("fanin: NULL buffer", epx_fanin_reduce(NULL, &args, NULL), EPX_ERR_INVALID_ARG,
              "buffer");
    bi_expect("fanin: NULL args", epx_fanin_reduce(buffer, NULL, NULL), EPX_ERR_INVALID_ARG,
              "args");
    const char *culprit = NULL, *what = NULL;
    for (int i = 0;; i++) {
        epx_fanin_args_t bad = args;
        if ((what = break_args(i, &bad, dst, &culprit)) == NULL)
            break;
        bi_expect(what, epx_fanin_reduce(buffer, &bad, NULL), EPX_ERR_INVALID_ARG, culprit);
    }
    if (bi_info.ranks_per_node < R)
        /* Across nodes the sum is refused: it loads from peers' mapped memory. */
        bi_expect("fanin: group across nodes", epx_fanin_reduce(buffer, &args, NULL),
                  EPX_ERR_UNSUPPORTED, "nodes");
    mr_mem_sync();
    expect_untouched(dst, 0, "after the refusals");

    if (bi_info.ranks_per_node >= R) {
        /* The buffer still works: every rank sums (its peers' regions are read), into
         * the first FI_SUM_BYTES of each row of the full pitch only. */
        args.dst_pitch = FI_ROW_BYTES;
        CHECK_OK(epx_group_barrier(bi_group));
        CHECK_OK(epx_fanin_reduce(buffer, &args, NULL));
        mr_mem_sync();
        CHECK_OK(epx_group_barrier(bi_group));
        expect_untouched(dst, FI_SUM_BYTES, "after a valid call");
        printf("fanin: a valid call after the refusals went through\n");
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(dst);
}
