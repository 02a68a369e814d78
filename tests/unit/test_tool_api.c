/*
 * The tool support API (include/epx_tool.h): the tunables table read through it, buffer
 * planning for a group that is not formed, and the NVSHMEM plugin probe; every bad
 * argument refused.
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
    while (epx_param_info(rows, &info) == EPX_SUCCESS) {
        CHECK(info.name != NULL && strncmp(info.name, "EPX_", 4) == 0);
        CHECK(info.doc != NULL && info.doc[0] != '\0');
        if (info.is_int)
            CHECK_EQ_INT(info.int_value, epx__param_int((epx_param_id_t)rows));
        else
            CHECK(strcmp(info.string_value, epx__param_string((epx_param_id_t)rows)) == 0);
        rows++;
    }
    CHECK_EQ_INT(rows, EPX_PARAM_COUNT_);
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
    CHECK_EQ_INT((long long)untouched, 12345);
}

static void test_plugin_probe(void)
{
    char path[PATH_MAX];
    int version[3] = {0, 0, 0};
    CHECK_STATUS(epx_nvshmem_plugin_probe(NULL, sizeof(path), version), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_nvshmem_plugin_probe(path, 0, version), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_nvshmem_plugin_probe(path, sizeof(path), NULL), EPX_ERR_INVALID_ARG);
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
    test_plugin_probe();
    printf("test_tool_api: ok\n");
    return 0;
}
