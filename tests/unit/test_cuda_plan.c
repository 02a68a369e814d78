/*
 * The CUDA backend's host-side pieces that need no GPU: the memory plan every rank
 * shares (regions aligned, in order, not overlapping, large enough, the combine-input
 * region included), the configs it
 * refuses, and device discovery that never fails without a driver.
 */
#include <stdio.h>

#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include "cuda_plan_group.h"
#include "ops/cuda/cuda_backend.h"

static epx_buffer_config_t make_config(int64_t tokens, int64_t hidden, int experts, int topk)
{
    epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
    c.max_tokens_per_rank = tokens;
    c.hidden = hidden;
    c.num_experts = experts;
    c.num_topk = topk;
    return c;
}

/* Every region starts aligned, after the previous one ends, inside the allocation. */
static void check_plan(int world, int64_t tokens, int64_t hidden, int experts, int topk)
{
    struct epx_group g = cuda_plan_group(world - 1, world, world);
    epx_buffer_config_t c = make_config(tokens, hidden, experts, topk);
    epx__cuda_shape_t s;
    size_t slot = 0;
    CHECK_OK(epx__cuda_plan(&g, &c, &s, &slot));
    int64_t rows = tokens * world, L = experts / world;
    CHECK_EQ_INT(s.max_recv, rows);
    CHECK_EQ_INT(s.num_local_experts, L);
    CHECK_EQ_INT(s.rank, world - 1);
    CHECK_EQ_INT(s.timeout_ns, 1000000000ll);
    struct {
        int64_t offset, bytes;
    } regions[] = {
        {0, (int64_t)sizeof(epx__cuda_ctrl_t)},
        {s.off_slots, world * (int64_t)sizeof(epx__cuda_slot_t)},
        {s.off_rank_counts, 2ll * world * world * 4},
        {s.off_expert_counts, 2ll * world * L * 4},
        {s.off_x, rows * hidden * 2},
        {s.off_scales, hidden % 128 == 0 ? rows * (hidden / 128) * 4 : 0},
        {s.off_topk_idx, rows * topk * 8},
        {s.off_topk_weights, rows * topk * 4},
        {s.off_combine_weights, rows * topk * 4},
        {s.off_combine_input, rows * hidden * 2},
    };
    int64_t end = 0;
    for (size_t i = 0; i < sizeof(regions) / sizeof(regions[0]); i++) {
        if (regions[i].bytes == 0) {
            CHECK_EQ_INT(regions[i].offset, -1);
            continue;
        }
        CHECK(regions[i].offset >= end);
        if (i >= 2)
            CHECK_EQ_INT(regions[i].offset % 256, 0);
        end = regions[i].offset + regions[i].bytes;
    }
    CHECK(s.shared_bytes >= end);
    CHECK_EQ_INT(s.x_pitch_max, hidden * 2);
    /* The combine-input region is read in place with 16-byte vectors: its base and its
     * bf16 row pitch (hidden is a multiple of 8) are 16-byte aligned. */
    CHECK_EQ_INT(s.off_combine_input % 16, 0);
    CHECK_EQ_INT((hidden * 2) % 16, 0);
    /* What epx_buffer_size reports for this config covers every region. */
    size_t bytes = 0;
    CHECK_OK(epx__cuda_backend.buffer_size(&g, &c, &bytes));
    CHECK(bytes >= (size_t)end);
    /* A handle slot holds send_row [tokens][world], the count and [L] per-expert counts. */
    CHECK(slot >= (size_t)(tokens * world * 4 + 4 + L * 4));
}

static void check_refusals(void)
{
    epx__cuda_shape_t s;
    size_t slot = 0;
    epx_buffer_config_t c = make_config(64, 256, 128, 4);
    struct epx_group huge = cuda_plan_group(0, EPX_CUDA_MAX_RANKS * 2, EPX_CUDA_MAX_RANKS * 2);
    c.num_experts = EPX_CUDA_MAX_RANKS * 2;
    CHECK_STATUS(epx__cuda_plan(&huge, &c, &s, &slot), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("ranks");
    struct epx_group ok = cuda_plan_group(0, 2, 2);
    c = make_config(64, 256, EPX_CUDA_MAX_EXPERTS + 2, 4);
    CHECK_STATUS(epx__cuda_plan(&ok, &c, &s, &slot), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("experts");
}

/*
 * A fresh count scan's tiles (layout.cu): within the SM budget and EPX_CUDA_SCAN_TILES, a
 * block per round while the budget allows, whole rounds a tile, every token in exactly
 * one tile, no tile empty.
 */
static void check_scan_tiles(int64_t tokens, int64_t budget, int64_t want_blocks)
{
    const int64_t blocks = epx__cuda_scan_blocks(tokens, budget);
    if (want_blocks > 0)
        CHECK_EQ_INT(blocks, want_blocks);
    CHECK(blocks >= 1);
    CHECK(blocks <= (budget > 1 ? budget : 1) && blocks <= EPX_CUDA_SCAN_TILES);
    int64_t next = 0;
    for (int64_t tile = 0; tile < blocks; tile++) {
        int64_t first = -1, end = -1;
        epx__cuda_scan_tile(tokens, blocks, tile, &first, &end);
        CHECK_EQ_INT(first, next);
        CHECK(end > first || tokens == 0);
        CHECK(first % EPX_CUDA_NOTIFY_THREADS == 0);
        next = end;
    }
    CHECK_EQ_INT(next, tokens);
}

static void check_scan(void)
{
    check_scan_tiles(4096, 16, 4);  /* the standard case: a block per round */
    check_scan_tiles(4096, 8, 4);
    check_scan_tiles(4096, 2, 2);   /* two rounds a block */
    check_scan_tiles(1000, 16, 1);  /* one partial round */
    check_scan_tiles(0, 16, 1);     /* no tokens: one block, no tile of tokens */
    check_scan_tiles(1, 0, 1);      /* a budget below one still runs one block */
    check_scan_tiles(16384, 8, 8);
    check_scan_tiles(5 * 1024, 4, 3); /* 2 + 2 + 1 rounds: no empty fourth block */
    check_scan_tiles(200 * 1024 + 1, 132, 51); /* the tile cap: 4 rounds a block */
    for (int64_t tokens = 0; tokens <= 40 * 1024; tokens += 509)
        for (int64_t budget = 1; budget <= 70; budget += 3)
            check_scan_tiles(tokens, budget, 0);
}

/* Ranks sharing a GPU, by UUID: how many, the lowest, their SM budgets added up. */
static void check_gpu_share(void)
{
    /* 6 ranks: 0, 2, 5 on GPU A; 1, 4 on GPU B; 3 with an unknown GPU (all-zero UUID). */
    epx__cuda_gpu_vote_t votes[6];
    memset(votes, 0, sizeof(votes));
    const int gpu[6] = {'A', 'B', 'A', 0, 'B', 'A'};
    for (int r = 0; r < 6; r++) {
        votes[r].num_sms = 10 + r;
        if (gpu[r] != 0) {
            votes[r].uuid[0] = (uint8_t)gpu[r];
            votes[r].uuid[15] = 7;
        }
    }
    int ranks = -1, first = -1;
    int64_t sms = -1;
    epx__cuda_gpu_share(votes, 6, 5, &ranks, &first, &sms);
    CHECK(ranks == 3 && first == 0 && sms == 10 + 12 + 15);
    epx__cuda_gpu_share(votes, 6, 0, &ranks, &first, &sms);
    CHECK(ranks == 3 && first == 0 && sms == 37);
    epx__cuda_gpu_share(votes, 6, 4, &ranks, &first, &sms);
    CHECK(ranks == 2 && first == 1 && sms == 11 + 14);
    /* An unknown GPU is shared with nobody, not with the other unknown ones. */
    votes[1].uuid[0] = 0;
    votes[1].uuid[15] = 0;
    epx__cuda_gpu_share(votes, 6, 3, &ranks, &first, &sms);
    CHECK(ranks == 1 && first == 3 && sms == 13);
    epx__cuda_gpu_share(votes, 6, 1, &ranks, &first, &sms);
    CHECK(ranks == 1 && first == 1 && sms == 11);
    epx__cuda_gpu_share(votes, 6, 4, &ranks, &first, &sms);
    CHECK(ranks == 1 && first == 4 && sms == 14);
    /* UUIDs differing in their last byte only are two GPUs. */
    votes[2].uuid[15] = 8;
    epx__cuda_gpu_share(votes, 6, 2, &ranks, &first, &sms);
    CHECK(ranks == 1 && first == 2 && sms == 12);
}

/* Inputs mapped on demand: what every rank's records of one combine decide. */
static void check_auto_plan(void)
{
    epx__cuda_auto_t au;
    memset(&au, 0, sizeof(au));
    epx__cuda_auto_record_t all[9];
    epx__cuda_auto_plan_t plan;
    for (int r = 0; r < 9; r++)
        all[r] = (epx__cuda_auto_record_t){0, -1, 0, 0};
    /* Nobody needs anything: no mapping step. */
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(!plan.map && !plan.wanted && plan.used == 0 && plan.victim == -1);
    /* Rank 2 needs a mapping, every slot free: the first. */
    all[2].want = 1;
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(plan.map && plan.wanted && plan.victim == 0);
    /* ... while rank 5 is capturing a graph: nothing is mapped. */
    all[5].capturing = 1;
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(!plan.map && plan.capturing && plan.victim == -1);
    all[5].capturing = 0;
    /* Every slot occupied, read at different times: the least recently read that no
     * rank reads now (slot 3 was read at 1 but rank 0 reads it now: slot 6, read at 2). */
    const uint64_t last[EPX_CUDA_AUTO_SLOTS] = {9, 7, 8, 1, 5, 4, 2, 6};
    for (int i = 0; i < EPX_CUDA_AUTO_SLOTS; i++) {
        au.slots[i].occupied = 1;
        au.slots[i].last_use = last[i];
    }
    all[0].used = 3;
    all[1].used = 3;
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(plan.map && plan.victim == 6 && plan.used == (1u << 3));
    /* Every slot but 1 and 2 read in this call: the less recently read of those. */
    for (int r = 0; r < 8; r++)
        all[r].used = r == 2 ? -1 : r;
    all[1].used = 7;
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(plan.used == 0xf9 && plan.victim == 1);
    all[1].used = 2;
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(plan.used == 0xfd && plan.victim == 1);
    /* Every slot read in this call (a ninth rank reads slot 1): none to take (x copied
     * in), still one step. */
    all[8] = (epx__cuda_auto_record_t){0, 1, 0, 0};
    epx__cuda_auto_plan(&au, all, 9, &plan);
    CHECK(plan.used == 0xff && plan.map && plan.victim == -1);
    all[8].used = -1;
    /* Rank 2's freed allocations sit in slots 4 and 6; rank 4 reads slot 4 now: both are
     * evicted first, rank 4 maps its x again, and the new allocations go to slot 4. */
    all[2].stale = (1u << 4) | (1u << 6);
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(plan.stale == 0x50 && (plan.used & 0x50) == 0 && plan.wanted && plan.victim == 4);
    /* A stale slot alone (rank 4 reading elsewhere, nobody wanting but rank 2's record)
     * still runs the step. */
    all[2].want = 0;
    all[4].used = -1;
    all[6].used = -1;
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(plan.map && !plan.wanted && plan.stale == 0x50 && plan.victim == -1);
    /* Out-of-range slots and stale bits are ignored. */
    for (int r = 0; r < 8; r++)
        all[r] = (epx__cuda_auto_record_t){0, EPX_CUDA_AUTO_SLOTS, 1u << EPX_CUDA_AUTO_SLOTS, 0};
    epx__cuda_auto_plan(&au, all, 8, &plan);
    CHECK(!plan.map && plan.used == 0 && plan.stale == 0);
}

int main(void)
{
    /* Without a driver or GPU this is 0, never a failure or a crash. */
    int devices = epx__cuda_device_count();
    CHECK(devices >= 0);
    check_plan(8, 4096, 7168, 256, 8);
    check_plan(1, 1, 8, 1, 1);
    check_plan(3, 100, 136, 9, 2); /* hidden not a multiple of 128: no scales region */
    check_plan(EPX_CUDA_MAX_RANKS, 17, 384, EPX_CUDA_MAX_RANKS * 2, 3);
    check_refusals();
    check_scan();
    check_gpu_share();
    check_auto_plan();
    printf("test_cuda_plan: ok (%d CUDA device%s visible)\n", devices, devices == 1 ? "" : "s");
    return 0;
}
#else
int main(void)
{
    printf("test_cuda_plan: skipped (built without the CUDA backend)\n");
    return 0;
}
#endif
