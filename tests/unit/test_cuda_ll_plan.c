/*
 * The CUDA backend's low-latency memory plan (src/ops/cuda/ll_setup.c), which needs no
 * GPU: every region of the symmetric heap and of the local memory aligned, in order,
 * not overlapping and large enough (rows sized by low_latency_dtype, the puts' staging
 * only across nodes); both slots alike; what epx_buffer_size adds for it; the standard
 * case's size; the configs it refuses, each naming why. All of it for both generations
 * of kernels (EPX_LL_KERNELS=1 and 2; kernels 2 fall back to 1 above 32 top-k entries),
 * and that kernels 1 refuse wait_recv_cost_stats.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include "cuda_plan_group.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"

typedef struct {
    size_t offset, bytes;
} region_t;

static epx_buffer_config_t make_config(int64_t m, int64_t hidden, int experts, int topk)
{
    epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
    c.max_tokens_per_rank = m > 0 ? m : 16;
    c.max_low_latency_tokens = m;
    c.hidden = hidden;
    c.num_experts = experts;
    c.num_topk = topk;
    c.num_sms = 16;
    return c;
}

/* Regions in the given order: each aligned to 256 bytes and after the previous one. */
static size_t check_regions(const region_t *regions, size_t count)
{
    size_t end = 0;
    for (size_t i = 0; i < count; i++) {
        CHECK_EQ_INT(regions[i].offset % 256, 0);
        CHECK(regions[i].offset >= end);
        end = regions[i].offset + regions[i].bytes;
    }
    return end;
}

/* EPX_LL_KERNELS for the plans that follow. */
static int kernels = 1;

static void use_kernels(int which)
{
    setenv("EPX_LL_KERNELS", which == 2 ? "2" : "1", 1);
    epx__params_reset();
    CHECK_OK(epx__params_load());
    kernels = which;
}

static void check_plan(int world, int nodes, int64_t m, int64_t hidden, int experts, int topk,
                       epx_dtype_t dtype)
{
    struct epx_group g = cuda_plan_group(world - 1, world, world);
    g.ranks_per_node = world / nodes;
    epx_buffer_config_t c = make_config(m, hidden, experts, topk);
    c.low_latency_dtype = dtype;
    epx_ll_shape_t s;
    size_t sym = 0, local = 0;
    CHECK_OK(epx__cuda_ll_plan(&g, &c, &s, &sym, &local));
    size_t L = (size_t)(experts / world), rows = (size_t)(m * world), H = (size_t)hidden;
    size_t S = hidden % 128 == 0 ? H / 128 : 0, cells = L * (size_t)world * (size_t)m;
    size_t row = dtype == EPX_DTYPE_FP8_E4M3 ? H : H * 2, puts = nodes > 1;
    CHECK_EQ_INT(s.rows, (int64_t)rows);
    CHECK_EQ_INT(s.num_local, (int64_t)L);
    CHECK_EQ_INT(s.scale_cols, (int64_t)S);
    CHECK_EQ_INT(s.x_row_bytes, row);
    CHECK_EQ_INT(s.may_put, (int)puts);
    CHECK_EQ_INT(s.timeout_ns, 1000000000ll);
    CHECK_EQ_INT(s.blocks, 16);
    CHECK_EQ_INT(s.kernels, kernels == 2 && topk <= 32 ? 2 : 1);
    CHECK_EQ_INT(s.release, s.kernels == 2 ? 2 : 1); /* EPX_LL_RELEASE's default: 2 */
    size_t two = s.kernels == 2, one = 1 - two, E = (size_t)experts, k = (size_t)topk;

    /* Symmetric heap: the flags, then two slots with the same inner layout; the cells
     * are the dispatch results (packed in place, or placed there by kernels 2), one row
     * each; the puts' staging only when a peer may need puts; kernels 2's count exchange
     * and arrival counters. */
    region_t slot_regions[] = {
        {s.sent_count, one * L * (size_t)world * 4},
        {s.recv_x, cells * row},
        {s.recv_scales, cells * S * 4},
        {s.recv_src_info, cells * 4},
        {s.recv_topk, cells * 4},
        {s.recv_range, L * (size_t)world * 8},
        {s.combine_in, L * rows * H * 2},
        {s.combine_stage, puts * (size_t)m * k * H * 2},
        {s.send_x, one * puts * (size_t)m * row},
        {s.send_scales, one * puts * (size_t)m * S * 4},
        {s.counts, two * (size_t)world * (E + 1) * 8},
        {s.arrival, two * (size_t)world * 8},
        {s.combine_arrival, two * (size_t)world * 8},
        {s.count_stage, two * puts * (size_t)world * (E + 1) * 8},
        {s.put_x, two * puts * (size_t)m * k * row},
        {s.put_scales, two * puts * (size_t)m * k * S * 4},
        {s.put_src, two * puts * (size_t)m * k * 4},
        {s.put_topk, two * puts * (size_t)m * k * 4},
    };
    size_t slot_bytes = check_regions(slot_regions, sizeof(slot_regions) / sizeof(slot_regions[0]));
    region_t heap[] = {
        {s.flags, 4 * 2 * (size_t)world * 8},
        {s.slot[0], slot_bytes},
        {s.slot[1], slot_bytes},
    };
    CHECK(check_regions(heap, 3) <= sym);
    /* The zero-copy combine input is read with 16-byte vectors. */
    CHECK_EQ_INT((s.slot[1] + s.combine_in) % 16, 0);

    /* Local memory: two slots of bookkeeping, then the state. */
    region_t local_regions[] = {
        {s.recv_count, L * 4},
        {s.recv_src_rank, L * rows * 4},
        {s.send_pos, (size_t)m * (size_t)topk * 4},
        {s.sent_rows, two * (size_t)world * 4},
    };
    size_t results = check_regions(local_regions, sizeof(local_regions) / sizeof(local_regions[0]));
    CHECK(s.local_slot_bytes >= results);
    CHECK_EQ_INT(s.local_slot_bytes % 256, 0);
    /* seq, released, combined, arrive, mask + claim, peers, then arrived and
     * combine_arrived. */
    size_t state = 8 * 8 + 8 * 4 + ((size_t)world + 1) * 4 + 4 + (size_t)world * 8 +
                   4 * (size_t)world * 8;
    CHECK(local >= 2 * s.local_slot_bytes + state);

    /* epx_buffer_size counts it on top of normal mode's part (checked here on one node;
     * across nodes tests/unit/test_cuda_nodes.c checks the sum). */
    if (nodes > 1)
        return;
    size_t with = 0, without = 0;
    CHECK_OK(epx__cuda_backend.buffer_size(&g, &c, &with));
    c.max_low_latency_tokens = 0;
    CHECK_OK(epx__cuda_backend.buffer_size(&g, &c, &without));
    CHECK_EQ_INT(with - without, sym + local);
}

/* The standard low-latency case: what docs/PERFORMANCE.md reports for memory (DeepEP's
 * buffer for it is 1.9 GB). */
static void check_standard_case(void)
{
    struct epx_group g = cuda_plan_group(0, 8, 8);
    epx_buffer_config_t c = make_config(128, 7168, 256, 8);
    epx_ll_shape_t s;
    size_t sym = 0, local = 0;
    CHECK_OK(epx__cuda_ll_plan(&g, &c, &s, &sym, &local));
    CHECK(sym > 1890000000u && sym < 1900000000u);
    CHECK(local < 1000000u);
    c.low_latency_dtype = EPX_DTYPE_FP8_E4M3;
    CHECK_OK(epx__cuda_ll_plan(&g, &c, &s, &sym, &local));
    CHECK(sym > 1420000000u && sym < 1430000000u);
    CHECK(local < 1000000u);
}

static void check_refusals(void)
{
    epx_ll_shape_t s;
    size_t sym = 0, local = 0;
    struct epx_group g = cuda_plan_group(0, 2, 2);
    /* Low-latency off: nothing planned, nothing refused. */
    epx_buffer_config_t off = make_config(0, 100, 4, 2);
    CHECK_OK(epx__cuda_ll_plan(&g, &off, &s, &sym, &local));
    CHECK_EQ_INT(sym, 0);
    CHECK_EQ_INT(local, 0);
    /* 16-byte vectors: hidden must be a multiple of 8. */
    epx_buffer_config_t odd = make_config(16, 100, 4, 2);
    CHECK_STATUS(epx__cuda_ll_plan(&g, &odd, &s, &sym, &local), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("multiple of 8");
    /* The send kernel's shared memory bounds the experts. */
    epx_buffer_config_t many = make_config(16, 256, 20000, 2);
    CHECK_STATUS(epx__cuda_ll_plan(&g, &many, &s, &sym, &local), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("experts");
}

/*
 * wait_recv_cost_stats are timed by kernels 2 only: the backend's ll_check_wait_stats,
 * which the low-latency checks run before anything is sent, refuses them on a buffer
 * that runs kernels 1 (EPX_LL_KERNELS=1, or more than 32 top-k entries), naming the
 * operation and kernels 2. A buffer's state with only the plan in it: no GPU needed.
 */
static void check_wait_stats_kernels(void)
{
    struct epx_group g = cuda_plan_group(0, 2, 2);
    const int topks[2] = {8, 40};
    for (int i = 0; i < 2; i++) {
        epx_buffer_config_t c = make_config(33, 1024, 64, topks[i]);
        epx__cuda_ll_t ll;
        memset(&ll, 0, sizeof(ll));
        size_t sym = 0, local = 0;
        CHECK_OK(epx__cuda_ll_plan(&g, &c, &ll.shape, &sym, &local));
        epx__cuda_buffer_t cuda;
        memset(&cuda, 0, sizeof(cuda));
        cuda.ll = &ll;
        struct epx_buffer buffer;
        memset(&buffer, 0, sizeof(buffer));
        buffer.impl = &cuda;
        CHECK(epx__cuda_backend.ll_check_wait_stats != NULL);
        epx_status_t status = epx__cuda_backend.ll_check_wait_stats(&buffer, "ll_combine");
        if (kernels == 2 && topks[i] <= EPX_LL2_MAX_TOPK) {
            CHECK_EQ_INT(ll.shape.kernels, 2);
            CHECK_EQ_INT(status, EPX_SUCCESS);
            continue;
        }
        CHECK_EQ_INT(ll.shape.kernels, 1);
        CHECK_EQ_INT(status, EPX_ERR_UNSUPPORTED);
        CHECK_ERROR_MENTIONS("ll_combine: wait_recv_cost_stats");
        CHECK_ERROR_MENTIONS("kernels 2");
    }
}

/*
 * EPX_LL_RELEASE reaches the shape of kernels 2 only (kernels 1 have done flags alone), and
 * the vote before the symmetric heap finds the first rank whose settings differ.
 */
static void check_release(void)
{
    struct epx_group g = cuda_plan_group(0, 4, 4);
    epx_buffer_config_t c = make_config(128, 7168, 256, 8);
    epx_ll_shape_t s;
    size_t sym = 0, local = 0;
    for (int form = 1; form <= 2; form++) {
        setenv("EPX_LL_RELEASE", form == 2 ? "2" : "1", 1);
        for (int which = 1; which <= 2; which++) {
            use_kernels(which);
            CHECK_OK(epx__cuda_ll_plan(&g, &c, &s, &sym, &local));
            CHECK_EQ_INT(s.kernels, which);
            CHECK_EQ_INT(s.release, which == 2 ? form : 1);
        }
    }
    unsetenv("EPX_LL_RELEASE");

    epx__cuda_ll_vote_t votes[4];
    for (int r = 0; r < 4; r++)
        votes[r] = (epx__cuda_ll_vote_t){0, 2, 1};
    CHECK_EQ_INT(epx__cuda_ll_settings_differ(votes, 4), -1);
    CHECK_EQ_INT(epx__cuda_ll_settings_differ(votes, 1), -1);
    votes[3].release = 2;
    CHECK_EQ_INT(epx__cuda_ll_settings_differ(votes, 4), 3);
    votes[2].kernels = 1;
    CHECK_EQ_INT(epx__cuda_ll_settings_differ(votes, 4), 2);
    /* Rank 0 is the reference: when it alone differs, rank 1 is named. */
    for (int r = 0; r < 4; r++)
        votes[r] = (epx__cuda_ll_vote_t){0, 2, 2};
    votes[0].release = 1;
    CHECK_EQ_INT(epx__cuda_ll_settings_differ(votes, 4), 1);
}

int main(void)
{
    check_release();
    for (int which = 1; which <= 2; which++) {
        use_kernels(which);
        check_plan(8, 1, 128, 7168, 256, 8, EPX_DTYPE_BF16);
        check_plan(8, 1, 128, 7168, 256, 8, EPX_DTYPE_FP8_E4M3);
        check_plan(8, 2, 128, 7168, 256, 8, EPX_DTYPE_FP8_E4M3); /* two nodes: puts reserved */
        check_plan(8, 2, 128, 7168, 256, 8, EPX_DTYPE_BF16);
        check_plan(1, 1, 1, 8, 1, 1, EPX_DTYPE_BF16);
        check_plan(3, 1, 7, 136, 9, 9, EPX_DTYPE_BF16); /* hidden not a multiple of 128: no scales; topk = E */
        check_plan(2, 2, 33, 1024, 64, 40, EPX_DTYPE_BF16); /* more than 32 top-k entries */
        check_standard_case();
        check_refusals();
        check_wait_stats_kernels();
    }
    unsetenv("EPX_LL_KERNELS");
    epx__params_reset();
    printf("test_cuda_ll_plan: ok\n");
    return 0;
}
#else
int main(void)
{
    printf("test_cuda_ll_plan: skipped (built without the CUDA backend)\n");
    return 0;
}
#endif
