/*
 * CUDA buffers on groups that span nodes, without a GPU: the node count, the internode
 * regions of the memory plan (count messages, record and partial-sum slots, as worst-case
 * slots and as rings with their counters) lie inside the shared allocation without
 * overlapping, the handle slot holds the internode routing, and epx_buffer_size reports
 * the whole of it.
 */
#include <stdio.h>

#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include "cuda_plan_group.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/ll.h"

static epx_buffer_config_t make_config(int64_t ll_tokens)
{
    epx_buffer_config_t c = EPX_BUFFER_CONFIG_INIT;
    c.max_tokens_per_rank = 64;
    c.hidden = 256;
    c.num_experts = 32;
    c.num_topk = 4;
    c.num_sms = 16;
    c.max_low_latency_tokens = ll_tokens;
    return c;
}

static void check_nodes(void)
{
    struct epx_group one = cuda_plan_group(0, 4, 4), two = cuda_plan_group(3, 4, 2);
    struct epx_group eight = cuda_plan_group(5, 16, 2);
    CHECK_EQ_INT(epx__cuda_num_nodes(&one), 1);
    CHECK_EQ_INT(epx__cuda_num_nodes(&two), 2);
    CHECK_EQ_INT(epx__cuda_num_nodes(&eight), 8);
}

/* [a, a + bytes) inside [0, end) and after `*prev`; moves *prev past it. */
static void check_region(int64_t at, int64_t bytes, int64_t *prev, int64_t end)
{
    CHECK(at >= *prev);
    CHECK_EQ_INT(at % 256, 0);
    CHECK(at + bytes <= end);
    *prev = at + bytes;
}

static void check_plan(void)
{
    epx_buffer_config_t c = make_config(0);
    c.hidden = 7168;
    struct epx_group one = cuda_plan_group(5, 8, 8), two = cuda_plan_group(5, 8, 4);
    epx__cuda_shape_t s1, s2;
    size_t slot1 = 0, slot2 = 0;
    CHECK_OK(epx__cuda_plan(&one, &c, &s1, &slot1));
    CHECK_OK(epx__cuda_plan(&two, &c, &s2, &slot2));
    CHECK_EQ_INT(s1.num_nodes, 1);
    CHECK_EQ_INT(s1.ranks_per_node, 8);
    CHECK_EQ_INT(s2.num_nodes, 2);
    CHECK_EQ_INT(s2.ranks_per_node, 4);
    CHECK_EQ_INT(s2.max_tokens, 64);
    /* The single-node regions are where they are on one node. */
    CHECK_EQ_INT(s2.off_x, s1.off_x);
    CHECK_EQ_INT(s2.off_combine_input, s1.off_combine_input);

    int64_t T = 64, N = 2, R = 8, L = 4, K = 4, H = 7168;
    CHECK_EQ_INT(s2.xn_count_cols, 16); /* R + N + L + status = 15, rounded to 4 */
    epx__cuda_xn_record_t rec = epx__cuda_xn_record(H * 2, (int)(H / 128), (int)K, 4);
    CHECK_EQ_INT(rec.scales, H * 2);
    CHECK_EQ_INT(rec.topk_idx, H * 2 + (H / 128) * 4);
    CHECK_EQ_INT(rec.weights, rec.topk_idx + K * 8);
    CHECK_EQ_INT(rec.rows, rec.weights + K * 4);
    CHECK_EQ_INT(rec.bytes, (rec.rows + 4 * 4 + 15) / 16 * 16);
    CHECK_EQ_INT(s2.xn_record_pitch, rec.bytes);
    /* An fp8 record carries no bf16 padding. */
    epx__cuda_xn_record_t fp8 = epx__cuda_xn_record(H, (int)(H / 128), (int)K, 4);
    CHECK_EQ_INT(fp8.bytes, rec.bytes - H);
    CHECK_EQ_INT(s2.xn_partial_pitch, H * 2 + K * 4);

    int64_t prev = s1.off_combine_input + s1.max_recv * H * 2, end = s2.shared_bytes;
    check_region(s2.off_xn_counts, 2 * R * s2.xn_count_cols * 4, &prev, end);
    check_region(s2.off_xn_counts_out, R * s2.xn_count_cols * 4, &prev, end);
    check_region(s2.off_xn_inbox, N * T * rec.bytes, &prev, end);
    check_region(s2.off_xn_outbox, N * T * rec.bytes, &prev, end);
    check_region(s2.off_xn_partial_in, N * T * s2.xn_partial_pitch, &prev, end);
    check_region(s2.off_xn_partial_out, N * T * s2.xn_partial_pitch, &prev, end);
    CHECK_EQ_INT(s2.shared_bytes % (1 << 21), 0);

    /* The handle slot: the single-node routing, then node_pos, node_out, node_in, fwd_rows. */
    CHECK(slot2 > slot1);
    char *slot = calloc(1, slot2);
    CHECK(slot != NULL);
    epx__cuda_xn_routing_t routing;
    int64_t single = (int64_t)(T * R * 4 + 255) / 256 * 256 + 256 + (L * 4 + 255) / 256 * 256;
    epx__cuda_xn_routing(&s2, slot, single, &routing);
    CHECK((char *)routing.node_pos >= slot + single);
    CHECK((char *)routing.node_out >= (char *)(routing.node_pos + T * N));
    CHECK((char *)routing.node_in >= (char *)(routing.node_out + N));
    CHECK((char *)routing.fwd_rows >= (char *)(routing.node_in + N));
    CHECK((char *)(routing.fwd_rows + N * T * 4) <= slot + slot2);
    free(slot);
    /* One node: no internode routing. */
    epx__cuda_xn_routing(&s1, NULL, single, &routing);
    CHECK(routing.node_pos == NULL && routing.fwd_rows == NULL);
}

/*
 * EPX_XN_RING_TOKENS = C below max_tokens_per_rank: every record and partial-sum region
 * is [N][C], chunks of a quarter of the ring (at most 16), and the rings' counters
 * follow them; the plan with a ring is smaller by what the slots shrink. A ring of T or
 * more, or none, is the worst-case plan.
 */
static void check_ring_plan(void)
{
    epx_buffer_config_t c = make_config(0);
    c.hidden = 7168;
    struct epx_group two = cuda_plan_group(5, 8, 4);
    epx__cuda_shape_t worst, ring;
    size_t slot_worst = 0, slot_ring = 0;
    unsetenv("EPX_XN_RING_TOKENS");
    epx__params_reset();
    CHECK_OK(epx__params_load());
    CHECK_OK(epx__cuda_plan(&two, &c, &worst, &slot_worst));
    CHECK_EQ_INT(worst.xn_ring, 0);
    CHECK_EQ_INT(worst.xn_chunk, 0);
    CHECK_EQ_INT(worst.off_xn_ring, 0);

    setenv("EPX_XN_RING_TOKENS", "16", 1);
    epx__params_reset();
    CHECK_OK(epx__params_load());
    CHECK_OK(epx__cuda_plan(&two, &c, &ring, &slot_ring));
    int64_t N = 2, C = 16, G = 4, B = C / G;
    CHECK_EQ_INT(ring.xn_ring, C);
    CHECK_EQ_INT(ring.xn_chunk, G);
    CHECK_EQ_INT(ring.xn_record_pitch, worst.xn_record_pitch);
    CHECK_EQ_INT(ring.off_xn_inbox, worst.off_xn_inbox);
    /* The handle's routing still holds every record (combine reads it). */
    CHECK_EQ_INT(slot_ring, slot_worst);
    epx__cuda_xn_ring_layout_t l = epx__cuda_xn_ring_layout(N, B);
    CHECK_EQ_INT(l.dispatch_arrived, 0);
    CHECK_EQ_INT(l.combine_arrived, N * B * 8);
    CHECK_EQ_INT(l.dispatch_credit, 2 * N * B * 8);
    CHECK_EQ_INT(l.combine_done, l.dispatch_done + N * B * 4);
    CHECK_EQ_INT(l.bytes, 2 * N * B * 8 + 4 * N * 8 + 2 * N * B * 4);
    int64_t prev = ring.off_xn_inbox, end = ring.shared_bytes;
    check_region(ring.off_xn_inbox, N * C * ring.xn_record_pitch, &prev, end);
    check_region(ring.off_xn_outbox, N * C * ring.xn_record_pitch, &prev, end);
    check_region(ring.off_xn_partial_in, N * C * ring.xn_partial_pitch, &prev, end);
    check_region(ring.off_xn_partial_out, N * C * ring.xn_partial_pitch, &prev, end);
    check_region(ring.off_xn_ring, l.bytes, &prev, end);
    CHECK_EQ_INT(ring.shared_bytes % (1 << 21), 0);
    CHECK(ring.shared_bytes < worst.shared_bytes);

    /* Chunks: 1 for the smallest rings, 16 for large ones. */
    static const struct {
        const char *value;
        int64_t ring, chunk;
    } cases[] = {{"1", 1, 1}, {"2", 2, 1}, {"4", 4, 1}, {"8", 8, 2}, {"32", 32, 8},
                 {"64", 0, 0}, {"1024", 0, 0}, {"0", 0, 0}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        setenv("EPX_XN_RING_TOKENS", cases[i].value, 1);
        epx__params_reset();
        CHECK_OK(epx__params_load());
        epx__cuda_shape_t s;
        size_t slot = 0;
        CHECK_OK(epx__cuda_plan(&two, &c, &s, &slot));
        CHECK_EQ_INT(s.xn_ring, cases[i].ring); /* T = 64: a ring of 64 is no ring */
        CHECK_EQ_INT(s.xn_chunk, cases[i].chunk);
        if (cases[i].ring == 0)
            CHECK_EQ_INT(s.shared_bytes, worst.shared_bytes);
    }
    /* Large T: chunks stop at 16. */
    c.max_tokens_per_rank = 4096;
    setenv("EPX_XN_RING_TOKENS", "256", 1);
    epx__params_reset();
    CHECK_OK(epx__params_load());
    CHECK_OK(epx__cuda_plan(&two, &c, &ring, &slot_ring));
    CHECK_EQ_INT(ring.xn_ring, 256);
    CHECK_EQ_INT(ring.xn_chunk, 16);
    /* One node: no internode regions, whatever the setting. */
    struct epx_group one = cuda_plan_group(5, 8, 8);
    CHECK_OK(epx__cuda_plan(&one, &c, &ring, &slot_ring));
    CHECK_EQ_INT(ring.num_nodes, 1);
    CHECK_EQ_INT(ring.xn_ring, 0);
    unsetenv("EPX_XN_RING_TOKENS");
    epx__params_reset();
    CHECK_OK(epx__params_load());
}

static void check_sizes(void)
{
    struct epx_group one = cuda_plan_group(1, 4, 4), two = cuda_plan_group(1, 4, 2);
    epx_buffer_config_t both = make_config(16), normal_only = make_config(0);
    epx__cuda_shape_t s1, s2;
    size_t slot = 0;
    CHECK_OK(epx__cuda_plan(&one, &both, &s1, &slot));
    CHECK_OK(epx__cuda_plan(&two, &both, &s2, &slot));
    epx_ll_shape_t ll_shape;
    size_t one_sym = 0, one_local = 0, two_sym = 0, two_local = 0;
    CHECK_OK(epx__cuda_ll_plan(&one, &both, &ll_shape, &one_sym, &one_local));
    CHECK_OK(epx__cuda_ll_plan(&two, &both, &ll_shape, &two_sym, &two_local));
    size_t one_node = 0, across = 0, across_normal = 0;
    CHECK_OK(epx__cuda_backend.buffer_size(&one, &both, &one_node));
    CHECK_EQ_INT(one_node, (size_t)s1.shared_bytes + sizeof(epx__cuda_local_t) + one_sym +
                               one_local);
    CHECK_OK(epx__cuda_backend.buffer_size(&two, &both, &across));
    CHECK_EQ_INT(across, (size_t)s2.shared_bytes + sizeof(epx__cuda_local_t) + two_sym +
                             two_local);
    CHECK_OK(epx__cuda_backend.buffer_size(&two, &normal_only, &across_normal));
    CHECK_EQ_INT(across_normal, (size_t)s2.shared_bytes + sizeof(epx__cuda_local_t));
    CHECK(s2.shared_bytes > s1.shared_bytes);
}

int main(void)
{
    check_nodes();
    check_plan();
    check_ring_plan();
    check_sizes();
    printf("test_cuda_nodes: ok\n");
    return 0;
}
#else
int main(void)
{
    printf("test_cuda_nodes: skipped (built without the CUDA backend)\n");
    return 0;
}
#endif
