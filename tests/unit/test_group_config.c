/*
 * Group creation: every rejected config field gives its status and names the field;
 * the resolved values (backend, ranks per node, local rank, timeout) are right; the
 * callbacks path works and its failures become EPX_ERR_BOOTSTRAP; ranks that disagree
 * are caught; epx_group_create_from_env reads the launcher's variables.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fork_ranks.h"
#include "api.h"
#include "test_util.h"

#define SENTINEL ((epx_group_t)0x1234)

static epx_unique_id_t g_id;

/* The config must be refused with `status`, naming `needle`, leaving the output alone. */
static void check_refused(const epx_group_config_t *config, epx_status_t status,
                          const char *needle)
{
    epx_group_t group = SENTINEL;
    CHECK_STATUS(epx_group_create(config, &group), status);
    CHECK_ERROR_MENTIONS(needle);
    CHECK(group == SENTINEL);
}

static void test_rejected_fields(void)
{
    epx_unique_id_t id;
    CHECK_OK(epx_get_unique_id(&id));
    epx_group_config_t good = EPX_GROUP_CONFIG_INIT;
    epx_group_config_t config;

    epx_group_t group = SENTINEL;
    CHECK_STATUS(epx_group_create(NULL, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("config");
    CHECK_STATUS(epx_group_create(&good, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("group");

    config = good, config.size = sizeof(config) - 8;
    check_refused(&config, EPX_ERR_INVALID_ARG, "size");
    config = good, config.world_size = 0;
    check_refused(&config, EPX_ERR_INVALID_ARG, "world_size");
    config = good, config.rank = -1;
    check_refused(&config, EPX_ERR_INVALID_ARG, "rank -1");
    config = good, config.world_size = 2, config.rank = 2, config.unique_id = &id;
    check_refused(&config, EPX_ERR_INVALID_ARG, "rank 2");
    config = good, config.world_size = 2;
    check_refused(&config, EPX_ERR_INVALID_ARG, "unique_id or callbacks");

    epx_bootstrap_callbacks_t no_allgather = {NULL, NULL, NULL};
    config = good, config.unique_id = &id, config.callbacks = &no_allgather;
    check_refused(&config, EPX_ERR_INVALID_ARG, "both unique_id and callbacks");
    config = good, config.callbacks = &no_allgather;
    check_refused(&config, EPX_ERR_INVALID_ARG, "callbacks.allgather");

    config = good, config.world_size = 4, config.unique_id = &id, config.ranks_per_node = 3;
    check_refused(&config, EPX_ERR_INVALID_ARG, "ranks_per_node 3");
    config = good, config.ranks_per_node = -1;
    check_refused(&config, EPX_ERR_INVALID_ARG, "ranks_per_node -1");
    /* ranks_per_node left 0: EPX_RANKS_PER_NODE gives it, and must divide the world too. */
    setenv("EPX_RANKS_PER_NODE", "3", 1);
    config = good, config.world_size = 4, config.unique_id = &id;
    check_refused(&config, EPX_ERR_INVALID_ARG, "EPX_RANKS_PER_NODE=3 does not divide");
    unsetenv("EPX_RANKS_PER_NODE");
    config = good, config.backend = (epx_backend_t)7;
    check_refused(&config, EPX_ERR_INVALID_ARG, "backend 7");
    config = good, config.device = -2;
    check_refused(&config, EPX_ERR_INVALID_ARG, "device -2");
    config = good, config.timeout_ms = -5;
    check_refused(&config, EPX_ERR_INVALID_ARG, "timeout_ms -5");

#ifndef EPX_WITH_CUDA
    /* Asking for what the build lacks is "unsupported", with the reason. */
    config = good, config.backend = EPX_BACKEND_CUDA;
    check_refused(&config, EPX_ERR_UNSUPPORTED, "without CUDA");
#endif

    CHECK_STATUS(epx_group_destroy(NULL), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_group_barrier(NULL), EPX_ERR_INVALID_ARG);
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_STATUS(epx_group_get_info(NULL, &info), EPX_ERR_INVALID_ARG);
}

static void test_group_of_one(void)
{
    /* No id and no callbacks: a world of one needs no rendezvous. */
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    memset(&info, 0x7f, sizeof(info));
    /* A size the library does not know is refused and nothing is written. */
    info.size = sizeof(info) - 1;
    epx_group_info_t before = info;
    CHECK_STATUS(epx_group_get_info(group, &info), EPX_ERR_INVALID_ARG);
    CHECK(strstr(epx_last_error(), "EPX_GROUP_INFO_INIT") != NULL);
    CHECK(memcmp(&before, &info, sizeof(info)) == 0);
    info.size = sizeof(info);
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK(info.size == sizeof(info));
    CHECK_EQ_INT(info.rank, 0);
    CHECK_EQ_INT(info.world_size, 1);
    CHECK_EQ_INT(info.local_rank, 0);
    CHECK_EQ_INT(info.ranks_per_node, 1);
    CHECK(info.backend == EPX_BACKEND_HOST || info.backend == EPX_BACKEND_CUDA);
    CHECK_EQ_INT(group->timeout_ms, epx__param_int(EPX_PARAM_TIMEOUT_MS));
    CHECK_OK(epx_group_barrier(group));
    int64_t mine = 42, all = 0;
    CHECK_OK(epx__bootstrap_allgather(group->bootstrap, &mine, &all, sizeof(mine)));
    CHECK_EQ_INT(all, 42);
    /* The public allgather: values, and every bad argument refused. */
    mine = 4242;
    all = 0;
    CHECK_OK(epx_group_allgather(group, &mine, &all, sizeof(mine)));
    CHECK_EQ_INT(all, 4242);
    CHECK_STATUS(epx_group_allgather(NULL, &mine, &all, sizeof(mine)), EPX_ERR_INVALID_ARG);
    CHECK(strstr(epx_last_error(), "group is NULL") != NULL);
    CHECK_STATUS(epx_group_allgather(group, NULL, &all, sizeof(mine)), EPX_ERR_INVALID_ARG);
    CHECK(strstr(epx_last_error(), "send is NULL") != NULL);
    CHECK_STATUS(epx_group_allgather(group, &mine, NULL, sizeof(mine)), EPX_ERR_INVALID_ARG);
    CHECK(strstr(epx_last_error(), "recv is NULL") != NULL);
    CHECK_STATUS(epx_group_allgather(group, &mine, &all, 0), EPX_ERR_INVALID_ARG);
    CHECK(strstr(epx_last_error(), "bytes is 0") != NULL);
    CHECK_STATUS(epx_group_allgather(group, &mine, &all, SIZE_MAX), EPX_ERR_INVALID_ARG);
    CHECK_EQ_INT(all, 4242);
    epx_group_info_t untouched = info;
    CHECK_STATUS(epx_group_get_info(group, NULL), EPX_ERR_INVALID_ARG);
    CHECK(memcmp(&untouched, &info, sizeof(info)) == 0);
    CHECK_OK(epx_group_destroy(group));

    /* Host backend, an explicit timeout, and an id that a world of one ignores. */
    epx_unique_id_t id;
    CHECK_OK(epx_get_unique_id(&id));
    config.backend = EPX_BACKEND_HOST;
    config.timeout_ms = 1234;
    config.device = 3; /* ignored by the host backend */
    config.unique_id = &id;
    CHECK_OK(epx_group_create(&config, &group));
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.backend, EPX_BACKEND_HOST);
    CHECK_EQ_INT(info.device, -1);
    CHECK_EQ_INT(group->timeout_ms, 1234);
    CHECK_OK(epx_group_destroy(group));
}

/* ---------------------------------------------------------------- callbacks */

typedef struct {
    int world_size;    /* what the fake framework pretends */
    int fail_code;     /* nonzero: allgather returns it */
    int barrier_code;  /* what barrier returns */
    int allgathers;
    int barriers;
} fake_framework_t;

static int fake_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    fake_framework_t *framework = ctx;
    framework->allgathers++;
    if (framework->fail_code != 0)
        return framework->fail_code;
    /* Every slot gets this process's block, as a framework with a bug in its rank
     * order would do when world_size > 1. */
    for (int r = 0; r < framework->world_size; r++)
        memcpy((char *)recv + (size_t)r * bytes, send, bytes);
    return 0;
}

static int fake_barrier(void *ctx)
{
    fake_framework_t *framework = ctx;
    framework->barriers++;
    return framework->barrier_code;
}

static void test_callbacks(void)
{
    fake_framework_t framework = {.world_size = 1};
    epx_bootstrap_callbacks_t callbacks = {fake_allgather, fake_barrier, &framework};
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.backend = EPX_BACKEND_HOST;
    config.callbacks = &callbacks;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    CHECK(framework.allgathers >= 1); /* the config agreement went through the callback */
    CHECK_OK(epx_group_barrier(group));
    CHECK_EQ_INT(framework.barriers, 1);

    /* A failing barrier is EPX_ERR_BOOTSTRAP with the code; it then sticks. */
    framework.barrier_code = 9;
    CHECK_STATUS(epx_group_barrier(group), EPX_ERR_BOOTSTRAP);
    CHECK_ERROR_MENTIONS("returned 9");
    framework.barrier_code = 0;
    CHECK_STATUS(epx_group_barrier(group), EPX_ERR_BOOTSTRAP);
    CHECK_OK(epx_group_destroy(group));

    /* No barrier callback: the barrier runs as an allgather. */
    epx_bootstrap_callbacks_t allgather_only = {fake_allgather, NULL, &framework};
    config.callbacks = &allgather_only;
    CHECK_OK(epx_group_create(&config, &group));
    int before = framework.allgathers;
    CHECK_OK(epx_group_barrier(group));
    CHECK_EQ_INT(framework.allgathers, before + 1);
    CHECK_OK(epx_group_destroy(group));

    /* A failing allgather fails the creation with EPX_ERR_BOOTSTRAP. */
    framework.fail_code = 5;
    config.callbacks = &callbacks;
    check_refused(&config, EPX_ERR_BOOTSTRAP, "returned 5");

    /* A framework whose order does not match config.rank is caught. */
    framework.fail_code = 0;
    framework.world_size = 2;
    config.world_size = 2;
    check_refused(&config, EPX_ERR_INVALID_ARG, "position 1");
}

/* ---------------------------------------------------------------- several ranks */

/* A host-backend group of the shared unique id, with this node size (0: not given). */
static epx_group_config_t unique_id_config(int rank, int world_size, int ranks_per_node)
{
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = world_size;
    config.backend = EPX_BACKEND_HOST;
    config.ranks_per_node = ranks_per_node;
    config.unique_id = &g_id;
    config.timeout_ms = 8000;
    return config;
}

/* Make the group of `config` and check the node size and local rank it reports. */
static int check_nodes(const epx_group_config_t *config, int ranks_per_node, int local_rank)
{
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(config, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.ranks_per_node, ranks_per_node);
    CHECK_EQ_INT(info.local_rank, local_rank);
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_group_destroy(group));
    return 0;
}

static int body_local_ranks(int rank, int world_size, void *arg)
{
    (void)arg;
    if (rank == 3) {
        /* A launcher's EPX_LOCAL_RANK wins over rank % ranks_per_node. */
        setenv("EPX_LOCAL_RANK", "5", 1);
        epx__params_reset();
    }
    epx_group_config_t config = unique_id_config(rank, world_size, 2);
    return check_nodes(&config, 2, rank == 3 ? 5 : rank % 2);
}

static int body_disagree(int rank, int world_size, void *arg)
{
    (void)arg;
    /* each divides 4; they disagree */
    epx_group_config_t config = unique_id_config(rank, world_size, rank == 2 ? 1 : 4);
    check_refused(&config, EPX_ERR_INVALID_ARG, "rank 2 has ranks_per_node 1, rank 0 has 4");
    return 0;
}

/* EPX_RANKS_PER_NODE for a group whose config leaves ranks_per_node 0 (here a unique
 * id; callbacks alike): the node size, and with it the local rank. */
static int body_nodes_from_env(int rank, int world_size, void *arg)
{
    (void)arg;
    setenv("EPX_RANKS_PER_NODE", "2", 1);
    epx__params_reset();
    epx_group_config_t config = unique_id_config(rank, world_size, 0);
    return check_nodes(&config, 2, rank % 2);
}

static void test_several_ranks(void)
{
    CHECK_OK(epx_get_unique_id(&g_id));
    if (run_ranks("local ranks", 4, 4, body_local_ranks, NULL) != 0)
        TEST_FAIL("local ranks were not resolved");
    CHECK_OK(epx_get_unique_id(&g_id));
    if (run_ranks("nodes from EPX_RANKS_PER_NODE", 4, 4, body_nodes_from_env, NULL) != 0)
        TEST_FAIL("EPX_RANKS_PER_NODE did not give a configured group its nodes");
    CHECK_OK(epx_get_unique_id(&g_id));
    if (run_ranks("disagree", 4, 4, body_disagree, NULL) != 0)
        TEST_FAIL("ranks that disagree were not all refused naming rank 2");
}

/* ---------------------------------------------------------------- from the environment */

static void set_env(const char *rank, const char *world_size, const char *id)
{
    const char *names[] = {"EPX_RANK", "EPX_WORLD_SIZE", "EPX_UNIQUE_ID"};
    const char *values[] = {rank, world_size, id};
    for (int i = 0; i < 3; i++) {
        if (values[i] != NULL)
            setenv(names[i], values[i], 1);
        else
            unsetenv(names[i]);
    }
    epx__params_reset();
}

static int body_from_env(int rank, int world_size, void *arg)
{
    char rank_text[16], size_text[16];
    snprintf(rank_text, sizeof(rank_text), "%d", rank);
    snprintf(size_text, sizeof(size_text), "%d", world_size);
    set_env(rank_text, size_text, arg);
    setenv("EPX_RANKS_PER_NODE", "1", 1);
    setenv("EPX_BACKEND", "host", 1);
    epx__params_reset();
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create_from_env(EPX_BACKEND_AUTO, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.rank, rank);
    CHECK_EQ_INT(info.world_size, world_size);
    CHECK_EQ_INT(info.ranks_per_node, 1);
    CHECK_EQ_INT(info.local_rank, 0);
    CHECK_EQ_INT(info.backend, EPX_BACKEND_HOST);
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_group_destroy(group));
    return 0;
}

static void test_from_env(void)
{
    epx_group_t group = SENTINEL;
    set_env(NULL, NULL, NULL);
    CHECK_OK(epx_group_create_from_env(EPX_BACKEND_HOST, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.world_size, 1);
    CHECK_EQ_INT(info.backend, EPX_BACKEND_HOST);
    CHECK_OK(epx_group_destroy(group));

    group = SENTINEL;
    set_env(NULL, "2", NULL);
    CHECK_STATUS(epx_group_create_from_env(EPX_BACKEND_HOST, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_RANK");
    set_env("0", "2", NULL);
    CHECK_STATUS(epx_group_create_from_env(EPX_BACKEND_HOST, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_UNIQUE_ID");
    set_env("0", "2", "epx1:not-an-id");
    CHECK_STATUS(epx_group_create_from_env(EPX_BACKEND_HOST, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_UNIQUE_ID");
    CHECK_STATUS(epx_group_create_from_env((epx_backend_t)9, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("backend 9");
    set_env("0", NULL, NULL);
    CHECK_STATUS(epx_group_create_from_env(EPX_BACKEND_HOST, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_RANK is set but EPX_WORLD_SIZE is not");
    set_env("2", "2", NULL);
    CHECK_STATUS(epx_group_create_from_env(EPX_BACKEND_HOST, &group), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_RANK=2 is not a rank of EPX_WORLD_SIZE=2");
    set_env(NULL, NULL, NULL);
    CHECK_STATUS(epx_group_create_from_env(EPX_BACKEND_HOST, NULL), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("group is NULL");
    CHECK(group == SENTINEL);

    epx_unique_id_t id;
    char id_text[EPX_UNIQUE_ID_BYTES];
    CHECK_OK(epx_get_unique_id(&id));
    CHECK_OK(epx_unique_id_to_string(&id, id_text, sizeof(id_text)));
    if (run_ranks("from env", 2, 2, body_from_env, id_text) != 0)
        TEST_FAIL("groups from the environment failed");
    set_env(NULL, NULL, NULL);
}

int main(void)
{
    alarm(100); /* the children have their own guards; this one covers the parent */
    test_rejected_fields();
    printf("ok   rejected_fields\n");
    test_group_of_one();
    printf("ok   group_of_one\n");
    test_callbacks();
    printf("ok   callbacks\n");
    test_several_ranks();
    printf("ok   several_ranks\n");
    test_from_env();
    printf("ok   from_env\n");
    return 0;
}
