/*
 * The tool support API (include/epx_tool.h): the tunables table read through it, buffer
 * planning for a group that is not formed, internode normal mode's plan (worst-case
 * slots and rings), and the NVSHMEM plugin probe; every bad argument refused.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "core_test_env.h"
#include "epx_tool.h"
#include "test_util.h"

static void test_params(void)
{
    unset_epx_environment();
    setenv("EPX_NUM_SMS", "24", 1);
    setenv("EPX_BACKEND", "HOST", 1);
    epx__params_reset();
    CHECK_OK(epx_params_load());

    /* Every row, in table order, agrees with the library's own reading. */
    epx_param_info_t info = EPX_PARAM_INFO_INIT;
    int rows = 0;
    while (rows < epx_param_count() && epx_param_info(rows, &info) == EPX_SUCCESS) {
        CHECK(info.name != NULL && strncmp(info.name, "EPX_", 4) == 0);
        CHECK(info.doc != NULL && info.doc[0] != '\0');
        if (info.is_int)
            CHECK_EQ_INT(info.int_value, epx__param_int((epx_param_id_t)rows));
        else
            CHECK(strcmp(info.string_value, epx__param_string((epx_param_id_t)rows)) == 0);
        rows++;
    }
    CHECK_EQ_INT(rows, EPX_PARAM_COUNT_);
    /* Past the last row: refused, naming the index. */
    CHECK_STATUS(epx_param_info(rows, &info), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("index");

    CHECK_OK(epx_param_find("EPX_NUM_SMS", &info));
    CHECK(info.is_int);
    CHECK_EQ_INT(info.int_value, 24);
    CHECK_EQ_INT(info.int_default, 16);
    CHECK(info.string_value == NULL);
    CHECK_OK(epx_param_find("EPX_BACKEND", &info));
    CHECK(!info.is_int);
    CHECK(strcmp(info.string_value, "host") == 0); /* words are lower-cased */
    CHECK(strcmp(info.string_default, "auto") == 0);

    /* Refusals, and nothing written on one. */
    epx_param_info_t before = info;
    CHECK_STATUS(epx_param_find("EPX_NO_SUCH", &info), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_NO_SUCH");
    CHECK(memcmp(&before, &info, sizeof(info)) == 0);
    CHECK_STATUS(epx_param_find(NULL, &info), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_param_info(-1, &info), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_param_info(0, NULL), EPX_ERR_INVALID_ARG);
    info.size = sizeof(info) - 8;
    CHECK_STATUS(epx_param_info(0, &info), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_PARAM_INFO_INIT");
    CHECK_STATUS(epx_params_print(NULL), EPX_ERR_INVALID_ARG);

    /* The printed table names the value in force. */
    char *text = NULL;
    size_t length = 0;
    FILE *out = open_memstream(&text, &length);
    CHECK(out != NULL);
    CHECK_OK(epx_params_print(out));
    fclose(out);
    CHECK(strstr(text, "EPX_NUM_SMS") != NULL && strstr(text, "24") != NULL);
    free(text);

    /* A bad value is refused naming the variable. */
    setenv("EPX_TIMEOUT_MS", "soon", 1);
    epx__params_reset();
    CHECK_STATUS(epx_params_load(), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_TIMEOUT_MS");
    unset_epx_environment();
    epx__params_reset();
    CHECK_OK(epx_params_load());
}

static void test_buffer_size_plan(void)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = 64;
    config.hidden = 256;
    config.num_experts = 16;
    config.num_topk = 4;
    config.max_low_latency_tokens = 8;

    /* The same answer as epx_buffer_size on a formed group of that shape. */
    epx_group_config_t group_config = EPX_GROUP_CONFIG_INIT;
    group_config.backend = EPX_BACKEND_HOST;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&group_config, &group));
    size_t formed = 0, planned = 0;
    CHECK_OK(epx_buffer_size(group, &config, &formed));
    CHECK_OK(epx_buffer_size_plan(EPX_BACKEND_HOST, 1, 0, &config, &planned));
    CHECK(formed > 0 && formed == planned);
    CHECK_OK(epx_group_destroy(group));

    /* More ranks: more receive rows, so more bytes per rank; rows per node divides. */
    size_t eight = 0;
    CHECK_OK(epx_buffer_size_plan(EPX_BACKEND_HOST, 8, 4, &config, &eight));
    CHECK(eight > planned);

    size_t untouched = 12345;
    CHECK_STATUS(epx_buffer_size_plan(EPX_BACKEND_HOST, 0, 0, &config, &untouched),
                 EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("world_size");
    CHECK_STATUS(epx_buffer_size_plan(EPX_BACKEND_HOST, 8, 3, &config, &untouched),
                 EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("ranks_per_node");
    CHECK_STATUS(epx_buffer_size_plan((epx_backend_t)7, 8, 0, &config, &untouched),
                 EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("backend");
    config.num_experts = 12; /* not a multiple of 8 ranks */
    CHECK_STATUS(epx_buffer_size_plan(EPX_BACKEND_HOST, 8, 0, &config, &untouched),
                 EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_buffer_size_plan(EPX_BACKEND_HOST, 8, 0, NULL, &untouched),
                 EPX_ERR_INVALID_ARG);
#ifndef EPX_WITH_CUDA
    /* Planning for a backend this build lacks: unsupported, naming it. */
    config.num_experts = 16;
    CHECK_STATUS(epx_buffer_size_plan(EPX_BACKEND_CUDA, 8, 0, &config, &untouched),
                 EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("backend cuda is not built");
#endif
    CHECK_EQ_INT((long long)untouched, 12345);
}

/* The internode plan of the standard case (4096 x 7168, top-8 of 256, 16 SMs) on 2 x 4
 * ranks, with EPX_XN_RING_TOKENS = `ring` ("" = unset). */
static epx_status_t standard_plan(const char *ring, epx_internode_plan_t *plan)
{
    if (ring[0] != '\0')
        setenv("EPX_XN_RING_TOKENS", ring, 1);
    else
        unsetenv("EPX_XN_RING_TOKENS");
    epx__params_reset();
    CHECK_OK(epx_params_load());
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = 4096;
    config.hidden = 7168;
    config.num_experts = 256;
    config.num_topk = 8;
    config.num_sms = 16;
    return epx_internode_plan(8, 4, &config, plan);
}

static void test_internode_plan(void)
{
    unset_epx_environment();
    epx_internode_plan_t worst = EPX_INTERNODE_PLAN_INIT;
#ifdef EPX_WITH_CUDA
    CHECK_OK(standard_plan("", &worst));
    /* A record: bf16 row, 56 fp32 scales, 8 int64 ids, 8 fp32 weights, 4 int32 rows. */
    const int64_t record = 7168 * 2 + 56 * 4 + 8 * 8 + 8 * 4 + 4 * 4;
    const int64_t partial = 7168 * 2 + 8 * 4;
    CHECK_EQ_INT(worst.num_nodes, 2);
    CHECK_EQ_INT(worst.credits, 0);
    CHECK_EQ_INT(worst.slots_per_channel, 4096);
    CHECK_EQ_INT(worst.chunk_tokens, 0);
    CHECK_EQ_INT(worst.record_bytes, record);
    CHECK_EQ_INT(worst.partial_bytes, partial);
    CHECK_EQ_INT(worst.record_slot_bytes, 2 * 2 * 4096 * record);
    CHECK_EQ_INT(worst.partial_slot_bytes, 2 * 2 * 4096 * partial);
    CHECK_EQ_INT(worst.num_sms, 16);
    CHECK_EQ_INT(worst.sender_warps, 256);
    CHECK_EQ_INT(worst.receiver_warps, 256);
    CHECK_EQ_INT(worst.credit_warps, 0);
    CHECK_EQ_INT(worst.puts_in_flight, 256);

    /* A ring of 64: the same record, 64 slots per channel, chunks of 16, one credit warp,
     * and the bytes per rank drop by what the slots shrink (up to the 2 MiB rounding and
     * the credit counters). */
    epx_internode_plan_t ring = EPX_INTERNODE_PLAN_INIT;
    CHECK_OK(standard_plan("64", &ring));
    CHECK_EQ_INT(ring.credits, 1);
    CHECK_EQ_INT(ring.slots_per_channel, 64);
    CHECK_EQ_INT(ring.chunk_tokens, 16);
    CHECK_EQ_INT(ring.record_bytes, record);
    CHECK_EQ_INT(ring.record_slot_bytes, 2 * 2 * 64 * record);
    CHECK_EQ_INT(ring.partial_slot_bytes, 2 * 2 * 64 * partial);
    CHECK_EQ_INT(ring.receiver_warps, 128);
    CHECK_EQ_INT(ring.sender_warps, 127);
    CHECK_EQ_INT(ring.credit_warps, 1);
    CHECK_EQ_INT(ring.puts_in_flight, 64);
    size_t saved = (worst.record_slot_bytes + worst.partial_slot_bytes) -
                   (ring.record_slot_bytes + ring.partial_slot_bytes);
    CHECK(worst.bytes_per_rank > ring.bytes_per_rank);
    CHECK(worst.bytes_per_rank - ring.bytes_per_rank + (4 << 20) >= saved);
    CHECK(worst.bytes_per_rank - ring.bytes_per_rank <= saved + (4 << 20));

    /* Chunks: a quarter of the ring, 1 to 16 records. */
    CHECK_OK(standard_plan("16", &ring));
    CHECK_EQ_INT(ring.chunk_tokens, 4);
    CHECK_EQ_INT(ring.puts_in_flight, 16);
    CHECK_OK(standard_plan("1", &ring));
    CHECK_EQ_INT(ring.slots_per_channel, 1);
    CHECK_EQ_INT(ring.chunk_tokens, 1);
    CHECK_OK(standard_plan("2048", &ring));
    CHECK_EQ_INT(ring.chunk_tokens, 16);
    /* A ring of max_tokens_per_rank or more never wraps: the worst-case slots. */
    CHECK_OK(standard_plan("4096", &ring));
    CHECK_EQ_INT(ring.credits, 0);
    CHECK_EQ_INT(ring.slots_per_channel, 4096);
    CHECK_EQ_INT(ring.bytes_per_rank, worst.bytes_per_rank);

    /* A bad value of the setting is refused when the table is read, naming it. */
    setenv("EPX_XN_RING_TOKENS", "48", 1);
    epx__params_reset();
    CHECK_STATUS(epx_params_load(), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_XN_RING_TOKENS=48");
    CHECK_ERROR_MENTIONS("power of two");
    unset_epx_environment();
    epx__params_reset();
    CHECK_OK(epx_params_load());

    /* Refusals, nothing written. */
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = 64;
    config.hidden = 256;
    config.num_experts = 16;
    config.num_topk = 4;
    epx_internode_plan_t plan = EPX_INTERNODE_PLAN_INIT;
    CHECK_OK(epx_internode_plan(4, 2, &config, &plan));
    epx_internode_plan_t before = plan;
    CHECK_STATUS(epx_internode_plan(8, 8, &config, &plan), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("two nodes");
    CHECK_STATUS(epx_internode_plan(8, 0, &config, &plan), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_internode_plan(8, 3, &config, &plan), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("ranks_per_node");
    CHECK_STATUS(epx_internode_plan(8, 2, NULL, &plan), EPX_ERR_INVALID_ARG);
    config.num_experts = 12; /* not a multiple of 8 ranks */
    CHECK_STATUS(epx_internode_plan(8, 2, &config, &plan), EPX_ERR_INVALID_ARG);
    CHECK(memcmp(&before, &plan, sizeof(plan)) == 0);
    CHECK_STATUS(epx_internode_plan(8, 2, &config, NULL), EPX_ERR_INVALID_ARG);
    plan.size = sizeof(plan) - 8;
    CHECK_STATUS(epx_internode_plan(4, 2, &config, &plan), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_INTERNODE_PLAN_INIT");
#else
    CHECK_STATUS(standard_plan("", &worst), EPX_ERR_UNSUPPORTED);
    CHECK_ERROR_MENTIONS("CUDA backend");
    /* The arguments are checked before the build is: the same refusals as with CUDA. */
    CHECK_STATUS(standard_plan("", NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_INTERNODE_PLAN_INIT");
    CHECK_STATUS(epx_internode_plan(8, 8, NULL, &worst), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("two nodes");
#endif
}

static void test_plugin_probe(void)
{
    char path[PATH_MAX];
    int version[3] = {0, 0, 0};
    CHECK_STATUS(epx_nvshmem_plugin_probe(NULL, sizeof(path), version), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("path is NULL or empty");
    CHECK_STATUS(epx_nvshmem_plugin_probe(path, 0, version), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("path is NULL or empty");
    CHECK_STATUS(epx_nvshmem_plugin_probe(path, sizeof(path), NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("version is NULL");
    /* Nowhere to find it: refused with where it looked (a build with CUDA), or because
     * this build never loads it. */
    setenv("EPX_NVSHMEM_PLUGIN", "/nonexistent/libepx_nvshmem.so", 1);
    epx__params_reset();
    CHECK_OK(epx_params_load());
    CHECK_STATUS(epx_nvshmem_plugin_probe(path, sizeof(path), version), EPX_ERR_UNSUPPORTED);
#ifdef EPX_WITH_CUDA
    CHECK_ERROR_MENTIONS("/nonexistent");
#else
    CHECK_ERROR_MENTIONS("without CUDA");
#endif
    unsetenv("EPX_NVSHMEM_PLUGIN");
    epx__params_reset();
}

int main(void)
{
    test_params();
    test_buffer_size_plan();
    test_internode_plan();
    test_plugin_probe();
    printf("test_tool_api: ok\n");
    return 0;
}
