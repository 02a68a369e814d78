/*
 * epx_fanout_copy (include/epx_tool.h): every bad argument refused on the rank that
 * passed it, with no effect; then the copy itself, with each kernel, checked against
 * where the header says rows go (every rank's rows, read back from this rank's
 * combine-input region).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bad_input.h"
#include "epx_tool.h"
#include "harness.h"
#include "mem.h"
#include "test_util.h"

#define FO_TOKENS 5                  /* max_tokens_per_rank of the buffer */
#define FO_ROW_BYTES (BI_HIDDEN * 2) /* the region's row pitch */
#define FO_COPY_BYTES 256            /* bytes of each row the copy moves (half a row) */
#define FO_UNTOUCHED 0xee

static uint8_t source_byte(int rank, int row)
{
    return (uint8_t)(1 + rank * FO_TOKENS + row);
}

/* Rows the header says row `row` of rank `source` goes to: does it reach `rank`? */
static int reaches(int source, int row, double fanout, int world_size, int rank)
{
    int64_t milli = (int64_t)(fanout * 1000.0 + 0.5);
    int count = (int)((row + 1) * milli / 1000 - row * milli / 1000);
    for (int j = 0; j < count; j++)
        if ((source + row + j) % world_size == rank)
            return 1;
    return 0;
}

/* Bad case `i` of run_bad_args applied to valid `a`: its name and the word the error
 * must name; NULL past the last case. */
static const char *break_args(int i, epx_fanout_args_t *a, void *src, const char **culprit)
{
    const int R = bi_info.world_size;
    switch (i) {
    case 0: *culprit = "size"; a->size -= 8; return "fanout: wrong args.size";
    case 1: *culprit = "kernel"; a->kernel = (epx_fanout_kernel_t)4; return "fanout: kernel 4";
    case 2: *culprit = "src"; a->src = NULL; return "fanout: NULL src";
    case 3: *culprit = "src"; a->src = (char *)src + 8; return "fanout: src off 16 bytes";
    case 4: *culprit = "rows"; a->rows = -1; return "fanout: rows -1";
    case 5: *culprit = "rows"; a->rows = FO_TOKENS + 1; return "fanout: rows past max_tokens";
    case 6: *culprit = "row_bytes"; a->row_bytes = 0; return "fanout: row_bytes 0";
    case 7: *culprit = "row_bytes"; a->row_bytes = 8; return "fanout: row_bytes 8";
    case 8: *culprit = "row_bytes"; a->row_bytes = FO_ROW_BYTES + 16; return "fanout: row_bytes past a row";
    case 9: *culprit = "src_pitch"; a->src_pitch = 128; return "fanout: src_pitch below a row";
    case 10: *culprit = "src_pitch"; a->src_pitch = FO_COPY_BYTES + 8; return "fanout: src_pitch off 16";
    case 11: *culprit = "fanout"; a->fanout = 0.5; return "fanout: fanout 0.5";
    case 12: *culprit = "fanout"; a->fanout = R + 1; return "fanout: fanout past the ranks";
    case 13: *culprit = "num_sms"; a->num_sms = -1; return "fanout: num_sms -1";
    case 14: *culprit = "num_sms"; a->num_sms = 2000; return "fanout: num_sms 2000";
    case 15: *culprit = "stages"; a->stages = 1; return "fanout: stages 1";
    case 16: *culprit = "stages"; a->stages = 9; return "fanout: stages 9";
    default: return NULL;
    }
}

static void run_bad_args(epx_buffer_t buffer, void *src)
{
    epx_fanout_args_t args = EPX_FANOUT_ARGS_INIT;
    args.src = src;
    args.rows = FO_TOKENS;
    args.row_bytes = FO_COPY_BYTES;
    bi_expect("fanout: NULL buffer", epx_fanout_copy(NULL, &args, NULL), EPX_ERR_INVALID_ARG,
              "buffer");
    bi_expect("fanout: NULL args", epx_fanout_copy(buffer, NULL, NULL), EPX_ERR_INVALID_ARG,
              "args");
    const char *culprit = NULL, *what = NULL;
    for (int i = 0;; i++) {
        epx_fanout_args_t bad = args;
        if ((what = break_args(i, &bad, src, &culprit)) == NULL)
            break;
        bi_expect(what, epx_fanout_copy(buffer, &bad, NULL), EPX_ERR_INVALID_ARG, culprit);
    }
}

static const char *kernel_name(epx_fanout_kernel_t kernel)
{
    return kernel == EPX_FANOUT_BULK ? "bulk" : kernel == EPX_FANOUT_STAGED ? "staged" : "vector";
}

/* One copy with `kernel` on `num_sms` SMs (0 = the buffer's) with `stages` slots a ring
 * (0 = the default), then this rank's region checked row by row. */
static void run_copy(epx_buffer_t buffer, const epx_tensor_t *region, void *src,
                     epx_fanout_kernel_t kernel, double fanout, int num_sms, int stages)
{
    const int R = bi_info.world_size, me = bi_info.rank;
    const size_t region_bytes = (size_t)R * FO_TOKENS * FO_ROW_BYTES;
    uint8_t *host = malloc(region_bytes);
    CHECK(host != NULL);
    memset(host, FO_UNTOUCHED, region_bytes);
    mr_mem_to_device(region->data, host, region_bytes);
    mr_mem_sync();
    CHECK_OK(epx_group_barrier(bi_group));

    epx_fanout_args_t args = EPX_FANOUT_ARGS_INIT;
    args.kernel = kernel;
    args.src = src;
    args.src_pitch = FO_ROW_BYTES;
    args.rows = FO_TOKENS;
    args.row_bytes = FO_COPY_BYTES;
    args.fanout = fanout;
    args.num_sms = num_sms;
    args.stages = stages;
    CHECK_OK(epx_fanout_copy(buffer, &args, NULL));
    mr_mem_sync();
    CHECK_OK(epx_group_barrier(bi_group));

    mr_mem_to_host(host, region->data, region_bytes);
    for (int source = 0; source < R; source++) {
        for (int row = 0; row < FO_TOKENS; row++) {
            const uint8_t *at = host + ((size_t)source * FO_TOKENS + (size_t)row) * FO_ROW_BYTES;
            int here = reaches(source, row, fanout, R, me);
            for (int b = 0; b < FO_ROW_BYTES; b++) {
                uint8_t want = here && b < FO_COPY_BYTES ? source_byte(source, row) : FO_UNTOUCHED;
                if (at[b] != want)
                    TEST_FAIL("rank %d: fanout %s %.2f (SMs %d, stages %d): row %d of rank %d, "
                              "byte %d is 0x%02x, expected 0x%02x",
                              me, kernel_name(kernel), fanout, num_sms, stages, row, source, b,
                              at[b], want);
            }
        }
    }
    printf("fanout %-6s %.2f (SMs %d, stages %d): rows of %d ranks where they belong\n",
           kernel_name(kernel), fanout, num_sms, stages, R);
    free(host);
}

void bi_run_fanout_cases(void)
{
    const int R = bi_info.world_size, me = bi_info.rank;
    /* Every token to every rank, so this rank's combine-input view spans the region. */
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = FO_TOKENS;
    config.hidden = BI_HIDDEN;
    config.num_experts = R;
    config.num_topk = R;
    epx_buffer_t buffer = NULL;
    CHECK_OK(epx_buffer_create(bi_group, &config, &buffer));
    int64_t idx[FO_TOKENS * 64];
    for (int t = 0; t < FO_TOKENS; t++)
        for (int j = 0; j < R; j++)
            idx[t * R + j] = j;
    void *x = mr_mem_alloc((size_t)FO_TOKENS * FO_ROW_BYTES, 0);
    void *idx_memory = mr_mem_from_host(idx, (size_t)FO_TOKENS * (size_t)R * 8);
    epx_dispatch_args_t dispatch = EPX_DISPATCH_ARGS_INIT;
    dispatch.x = epx_tensor_2d(x, EPX_DTYPE_BF16, FO_TOKENS, BI_HIDDEN);
    dispatch.topk_idx = epx_tensor_2d(idx_memory, EPX_DTYPE_INT64, FO_TOKENS, R);
    epx_dispatch_result_t result = EPX_DISPATCH_RESULT_INIT;
    CHECK_OK(epx_dispatch(buffer, &dispatch, &result, NULL));
    epx_tensor_t region = EPX_TENSOR_NONE;
    CHECK_OK(epx_get_combine_input(buffer, result.handle, &region));
    CHECK_EQ_INT(region.shape[0], (int64_t)R * FO_TOKENS);

    uint8_t rows[FO_TOKENS * FO_ROW_BYTES];
    for (int row = 0; row < FO_TOKENS; row++)
        memset(rows + row * FO_ROW_BYTES, source_byte(me, row), FO_ROW_BYTES);
    void *src = mr_mem_from_host(rows, sizeof(rows));

    run_bad_args(buffer, src);
    if (bi_info.ranks_per_node < R) {
        /* Across nodes the copy is refused: it stores into peers' mapped memory. */
        epx_fanout_args_t args = EPX_FANOUT_ARGS_INIT;
        args.kernel = EPX_FANOUT_VECTOR;
        args.src = src;
        args.rows = FO_TOKENS;
        args.row_bytes = FO_COPY_BYTES;
        args.fanout = 1.0;
        CHECK_STATUS(epx_fanout_copy(buffer, &args, NULL), EPX_ERR_UNSUPPORTED);
    }
    const double fanouts[] = {1.0, R > 1 ? 1.5 : 1.0, (double)R};
    for (int f = 0; f < 3 && bi_info.ranks_per_node >= R; f++) {
        run_copy(buffer, &region, src, EPX_FANOUT_VECTOR, fanouts[f], 0, 0);
        run_copy(buffer, &region, src, EPX_FANOUT_BULK, fanouts[f], 0, 0);
        run_copy(buffer, &region, src, EPX_FANOUT_STAGED, fanouts[f], 0, 0);
        /* One block, two slots: every row through a ring that wraps twice. */
        run_copy(buffer, &region, src, EPX_FANOUT_STAGED, fanouts[f], 1, 2);
    }

    CHECK_OK(epx_handle_destroy(result.handle));
    CHECK_OK(epx_buffer_destroy(buffer));
    mr_mem_free(src);
    mr_mem_free(x);
    mr_mem_free(idx_memory);
}
