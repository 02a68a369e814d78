/*
 * epx_group_create_from_env reads the launcher's variables (EPX_RANK, EPX_WORLD_SIZE,
 * EPX_UNIQUE_ID, EPX_LOCAL_RANK, EPX_RANKS_PER_NODE) when it is called, not from the
 * settings cached by an earlier epx call: a process that sets them with setenv after
 * its first epx call gets the group they describe, and variables that describe a group
 * of several ranks never silently give a group of one.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core_test_env.h"
#include "fork_ranks.h"
#include "test_util.h"

/* An epx call that reads the settings: afterwards they are cached. */
static void first_call_with_nothing_set(void)
{
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create_from_env(EPX_BACKEND_HOST, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.world_size, 1);
    CHECK_OK(epx_group_destroy(group));
}

static void expect_refused(const char *needle)
{
    epx_group_t group = NULL;
    epx_status_t status = epx_group_create_from_env(EPX_BACKEND_HOST, &group);
    if (status == EPX_SUCCESS) {
        epx_group_info_t info = EPX_GROUP_INFO_INIT;
        CHECK_OK(epx_group_get_info(group, &info));
        TEST_FAIL("create_from_env succeeded with a group of %d rank(s); expected "
                  "EPX_ERR_INVALID_ARG naming %s",
                  info.world_size, needle);
    }
    CHECK_STATUS(status, EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS(needle);
    CHECK(group == NULL);
}

static void test_set_after_first_call(void)
{
    unset_epx_environment();
    first_call_with_nothing_set();
    /* Variables for a group of two, with an id that cannot be parsed: refused, and
     * certainly not a group of one. */
    setenv("EPX_RANK", "0", 1);
    setenv("EPX_WORLD_SIZE", "2", 1);
    setenv("EPX_UNIQUE_ID", "epx1:not-an-id", 1);
    expect_refused("EPX_UNIQUE_ID");
    setenv("EPX_WORLD_SIZE", "two", 1);
    expect_refused("EPX_WORLD_SIZE");
    /* A rank or an id without a world size is a launcher half set, not a group of one. */
    unsetenv("EPX_WORLD_SIZE");
    setenv("EPX_RANK", "1", 1);
    expect_refused("EPX_WORLD_SIZE");
    unsetenv("EPX_RANK");
    expect_refused("EPX_WORLD_SIZE");
    unsetenv("EPX_UNIQUE_ID");
    first_call_with_nothing_set(); /* all unset again: a group of one */
}

static int body_late(int rank, int world_size, void *arg)
{
    unset_epx_environment();
    first_call_with_nothing_set();
    char rank_text[16], size_text[16];
    snprintf(rank_text, sizeof rank_text, "%d", rank);
    snprintf(size_text, sizeof size_text, "%d", world_size);
    setenv("EPX_RANK", rank_text, 1);
    setenv("EPX_WORLD_SIZE", size_text, 1);
    setenv("EPX_UNIQUE_ID", arg, 1);
    setenv("EPX_LOCAL_RANK", "5", 1);
    setenv("EPX_RANKS_PER_NODE", "1", 1);
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create_from_env(EPX_BACKEND_HOST, &group));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.rank, rank);
    CHECK_EQ_INT(info.world_size, world_size);
    CHECK_EQ_INT(info.local_rank, 5);
    CHECK_EQ_INT(info.ranks_per_node, 1);
    CHECK_OK(epx_group_barrier(group));
    CHECK_OK(epx_group_destroy(group));
    return 0;
}

static void test_group_of_two_set_late(void)
{
    epx_unique_id_t id;
    char id_text[2 * EPX_UNIQUE_ID_BYTES];
    CHECK_OK(epx_get_unique_id(&id));
    CHECK_OK(epx_unique_id_to_string(&id, id_text, sizeof id_text));
    if (run_ranks("set late", 2, 2, body_late, id_text) != 0)
        TEST_FAIL("a group of two from variables set after the first epx call failed");
}

int main(void)
{
    alarm(60);
    test_set_after_first_call();
    printf("ok   set_after_first_call\n");
    test_group_of_two_set_late();
    printf("ok   group_of_two_set_late\n");
    return 0;
}
