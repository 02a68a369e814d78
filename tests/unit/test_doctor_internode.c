/*
 * `epx doctor`'s env.internode judgement (tools/doctor/doctor_internode.c) on made-up
 * settings and plans: every value is reported, set or default; each known bad value is
 * a warning whose fix names the setting; a refused plan is a skip.
 */
#include <stdio.h>
#include <string.h>

#include "doctor_internode.h"
#include "test_util.h"

/* The standard case at 2 x 4 with the worst-case slots, 16 SMs: nothing wrong. */
static epx__doctor_internode_in_t clean(void)
{
    epx__doctor_internode_in_t in;
    memset(&in, 0, sizeof(in));
    in.disable_nvls = "1";
    in.timeout_ms = 30000;
    in.world_size = 8;
    in.ranks_per_node = 4;
    in.gpus = 1;
    in.tokens = 4096;
    in.plan_ok = 1;
    in.plan = (epx_internode_plan_t)EPX_INTERNODE_PLAN_INIT;
    in.plan.num_nodes = 2;
    in.plan.slots_per_channel = 4096;
    in.plan.bytes_per_rank = 1428162336;
    in.plan.puts_in_flight = 256;
    in.plan.num_sms = 16;
    return in;
}

static char detail[EPX__DOCTOR_DETAIL_MAX], fix[EPX__DOCTOR_FIX_MAX];

static epx__doctor_status_t assess(const epx__doctor_internode_in_t *in)
{
    return epx__doctor_internode_assess(in, detail, sizeof(detail), fix, sizeof(fix));
}

static void expect_detail(const char *text)
{
    if (strstr(detail, text) == NULL)
        TEST_FAIL("the detail lacks '%s':\n%s", text, detail);
}

static void expect_fix(const char *text)
{
    if (strstr(fix, text) == NULL)
        TEST_FAIL("the fix lacks '%s': '%s' (detail:\n%s)", text, fix, detail);
}

static void check_clean(void)
{
    epx__doctor_internode_in_t in = clean();
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);
    CHECK_EQ_INT(fix[0], '\0');
    expect_detail("internode normal mode, 8 ranks as 2 nodes x 4, 4096 tokens/rank: slots for "
                  "the worst case, 4096 tokens per (rank, node) channel, no credits "
                  "(EPX_XN_RING_TOKENS=0)");
    expect_detail("at most 256 puts in flight to one peer (16 SMs)");
    expect_detail("\nNVSHMEM_IB_ENABLE_IBGDA=unset (off: ");
    expect_detail("\nNVSHMEM_IBGDA_NUM_RC_PER_PE=unset (NVSHMEM's default");
    expect_detail("\nNVSHMEM_QP_DEPTH=unset (NVSHMEM's default, 1024 work requests)");
    expect_detail("\nNVSHMEM_DISABLE_P2P=unset (P2P on)");
    expect_detail("\nNVSHMEM_DISABLE_NVLS=1");
    expect_detail("\nEPX_TIMEOUT_MS=30000");
    CHECK(strstr(detail, "problem") == NULL);
    CHECK(strstr(detail, "NVSHMEM_IBGDA_QP_DEPTH") == NULL); /* listed only when set */

    /* Set values are shown as they are. */
    in.ib_enable_ibgda = "1";
    in.ibgda_num_rc_per_pe = "4";
    in.qp_depth = "2048";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);
    expect_detail("\nNVSHMEM_IB_ENABLE_IBGDA=1\n");
    expect_detail("\nNVSHMEM_IBGDA_NUM_RC_PER_PE=4\n");
    expect_detail("\nNVSHMEM_QP_DEPTH=2048\n");
}

static void check_qp_depth(void)
{
    /* 256 puts in flight hold 512 work requests: a depth of 256 is too shallow. */
    epx__doctor_internode_in_t in = clean();
    in.qp_depth = "256";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_fix("raise NVSHMEM_QP_DEPTH to 512 or more, or make EPX_XN_RING_TOKENS smaller");
    expect_detail("problem: a queue pair of 256 work requests is shallower than the 512");
    in.qp_depth = "512";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);

    /* A ring of 16 tokens keeps 16 puts in flight: the same depth is enough. */
    in = clean();
    in.qp_depth = "256";
    in.ring_tokens = 16;
    in.plan.credits = 1;
    in.plan.slots_per_channel = 16;
    in.plan.chunk_tokens = 4;
    in.plan.puts_in_flight = 16;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);
    expect_detail("rings of 16 tokens per (rank, node) channel, chunks of 4, credits "
                  "(EPX_XN_RING_TOKENS=16)");

    /* Not a number. */
    in = clean();
    in.qp_depth = "deep";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_detail("NVSHMEM_QP_DEPTH=deep is not a positive whole number");
    expect_fix("NVSHMEM_QP_DEPTH");
    in = clean();
    in.ibgda_num_rc_per_pe = "two";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_fix("NVSHMEM_IBGDA_NUM_RC_PER_PE");
    in.ibgda_num_rc_per_pe = "0"; /* no RC queue pairs (DCI): a valid choice */
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);

    /* The IBGDA-specific name NVSHMEM 3 does not read. */
    in = clean();
    in.ibgda_qp_depth = "4096";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_detail("\nNVSHMEM_IBGDA_QP_DEPTH=4096\n");
    expect_detail("NVSHMEM_IBGDA_QP_DEPTH=4096 is not read by NVSHMEM 3");
    expect_fix("set NVSHMEM_QP_DEPTH instead");
    in.qp_depth = "4096";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);
}

static void check_p2p_nvls_timeout(void)
{
    epx__doctor_internode_in_t in = clean();
    in.disable_p2p = "1";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_detail("NVSHMEM_DISABLE_P2P=1 with 4 ranks per node");
    expect_fix("unset NVSHMEM_DISABLE_P2P");
    in.disable_p2p = "TRUE";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    in.disable_p2p = "0";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);
    /* One rank per node: no peer inside a node to reach directly. */
    in.disable_p2p = "1";
    in.ranks_per_node = 1;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);

    /* NVLS on while 8 ranks share one GPU; fine when each rank has its own. */
    in = clean();
    in.disable_nvls = NULL;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_detail("\nNVSHMEM_DISABLE_NVLS=unset (");
    expect_detail("8 ranks share 1 GPU with NVLink multicast (NVLS) on");
    expect_fix("export NVSHMEM_DISABLE_NVLS=1");
    in.gpus = 8;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);
    in.gpus = 0; /* no GPU seen: nothing to say */
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);

    in = clean();
    in.timeout_ms = 500;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_detail("EPX_TIMEOUT_MS=500 is under a second");
    expect_fix("EPX_TIMEOUT_MS");
    in.timeout_ms = 1000;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_PASS);

    /* Several problems: all in the detail, the first one's fix. */
    in = clean();
    in.disable_p2p = "1";
    in.timeout_ms = 10;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    expect_detail("NVSHMEM_DISABLE_P2P=1 with");
    expect_detail("EPX_TIMEOUT_MS=10 is under a second");
    expect_fix("unset NVSHMEM_DISABLE_P2P");
}

static void check_refused_plan(void)
{
    epx__doctor_internode_in_t in = clean();
    in.plan_ok = 0;
    in.plan_error = "internode_plan: this epx was built without the CUDA backend";
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_SKIP);
    expect_detail("not planned: internode_plan: this epx was built without the CUDA backend");
    expect_detail("\nNVSHMEM_QP_DEPTH=unset"); /* the settings are still listed */
    CHECK(strstr(detail, "puts in flight") == NULL);
    /* Settings known bad whatever the plan still warn. */
    in.timeout_ms = 1;
    CHECK_EQ_INT(assess(&in), EPX__DOCTOR_WARN);
    /* A detail that does not fit is cut, never overrun. */
    char small[40], small_fix[8];
    in.timeout_ms = 1;
    CHECK_EQ_INT(epx__doctor_internode_assess(&in, small, sizeof(small), small_fix,
                                              sizeof(small_fix)),
                 EPX__DOCTOR_WARN);
    CHECK(strlen(small) < sizeof(small) && strlen(small_fix) < sizeof(small_fix));
}

int main(void)
{
    check_clean();
    check_qp_depth();
    check_p2p_nvls_timeout();
    check_refused_plan();
    printf("test_doctor_internode: ok\n");
    return 0;
}
