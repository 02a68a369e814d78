/*
 * The tunables table: defaults, overrides, every kind of bad value, unknown EPX_*
 * names, the info log of changed values, and the printed table.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core_test_env.h"
#include "test_util.h"

static void test_defaults(void)
{
    unset_epx_environment();
    CHECK_OK(epx__params_load());
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_TIMEOUT_MS), 30000);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_NUM_SMS), 16);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_RANK), -1);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_WORLD_SIZE), 0);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_LOCAL_RANK), -1);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_RANKS_PER_NODE), 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_LOG_LEVEL), "warn") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_LOG_SUBSYS), "all") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_LOG_FILE), "") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_BACKEND), "auto") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_BOOTSTRAP_ADDR), "127.0.0.1") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_UNIQUE_ID), "") == 0);
    /* Asking for the wrong type or an id outside the table is harmless. */
    CHECK(strcmp(epx__param_string(EPX_PARAM_TIMEOUT_MS), "") == 0);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_COUNT_), 0);
}

static void test_overrides(void)
{
    unset_epx_environment();
    setenv("EPX_TIMEOUT_MS", "5000", 1);
    setenv("EPX_NUM_SMS", "1024", 1);         /* the maximum is allowed */
    setenv("EPX_RANK", "-1", 1);              /* so is the minimum */
    setenv("EPX_BACKEND", "HOST", 1);         /* words are case-insensitive, kept lower */
    setenv("EPX_LOG_SUBSYS", "Core, ops", 1);
    setenv("EPX_UNIQUE_ID", "10.0.0.1:1234:abcd", 1);
    setenv("EPX_WORLD_SIZE", "", 1);          /* empty counts as unset */
    epx__params_reset();
    CHECK_OK(epx__params_load());
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_TIMEOUT_MS), 5000);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_NUM_SMS), 1024);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_RANK), -1);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_WORLD_SIZE), 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_BACKEND), "host") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_LOG_SUBSYS), "core, ops") == 0);
    CHECK(strcmp(epx__param_string(EPX_PARAM_UNIQUE_ID), "10.0.0.1:1234:abcd") == 0);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_XN_RING_TOKENS), 0);
    static const char *const rings[] = {"0", "1", "16", "1048576"};
    for (int i = 0; i < 4; i++) {
        setenv("EPX_XN_RING_TOKENS", rings[i], 1);
        epx__params_reset();
        CHECK_OK(epx__params_load());
        CHECK_EQ_INT(epx__param_int(EPX_PARAM_XN_RING_TOKENS), atoll(rings[i]));
    }
    unsetenv("EPX_XN_RING_TOKENS");
    epx__params_reset();
    CHECK_OK(epx__params_load());

    /* The cache holds until reset, even when the environment changes. */
    setenv("EPX_TIMEOUT_MS", "7000", 1);
    CHECK_OK(epx__params_load());
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_TIMEOUT_MS), 5000);
    epx__params_reset();
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_TIMEOUT_MS), 7000); /* read without a load */
    CHECK_OK(epx__params_load());
    unset_epx_environment();
}

/* Loading with NAME=value set must fail and the message must mention each needle. */
static void expect_rejected(const char *name, const char *value, const char *needle1,
                            const char *needle2)
{
    unset_epx_environment();
    setenv("EPX_LOG_LEVEL", "none", 1); /* keep the expected errors out of the test log */
    setenv(name, value, 1);
    epx__params_reset();
    epx__clear_error();
    CHECK_STATUS(epx__params_load(), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS(name);
    CHECK_ERROR_MENTIONS(needle1);
    if (needle2 != NULL)
        CHECK_ERROR_MENTIONS(needle2);
    /* Every later load fails the same way until the environment is fixed. */
    epx__clear_error();
    CHECK_STATUS(epx__params_load(), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS(name);
}

static void test_bad_values(void)
{
    const char *range = "[1, 86400000]";
    expect_rejected("EPX_TIMEOUT_MS", "abc", "not an integer", range);
    expect_rejected("EPX_TIMEOUT_MS", "12x", "not an integer", range);
    expect_rejected("EPX_TIMEOUT_MS", "5000 ", "not an integer", range);
    expect_rejected("EPX_TIMEOUT_MS", "0x10", "not an integer", range);
    expect_rejected("EPX_TIMEOUT_MS", "0", "out of range", range);
    expect_rejected("EPX_TIMEOUT_MS", "86400001", "out of range", range);
    expect_rejected("EPX_TIMEOUT_MS", "99999999999999999999", "out of range", range);
    expect_rejected("EPX_RANK", "-2", "out of range", "[-1, 1048576]");
    expect_rejected("EPX_NUM_SMS", "1025", "out of range", "[1, 1024]");
    expect_rejected("EPX_LOG_LEVEL", "loud", "none, error, warn, info, debug, trace", NULL);
    expect_rejected("EPX_LOG_SUBSYS", "core,net", "\"net\"",
                    "core, bootstrap, transport, ops, tools, all");
    expect_rejected("EPX_LOG_SUBSYS", "core,,ops", "unknown subsystem", NULL);
    expect_rejected("EPX_BACKEND", "gpu", "auto, host, cuda", NULL);
    /* The internode ring: 0 or a power of two, within range. */
    expect_rejected("EPX_XN_RING_TOKENS", "3", "not a power of two", "[1, 1048576]");
    expect_rejected("EPX_XN_RING_TOKENS", "96", "not a power of two", "0 (slots for the");
    expect_rejected("EPX_XN_RING_TOKENS", "-16", "out of range", "[0, 1048576]");
    expect_rejected("EPX_XN_RING_TOKENS", "2097152", "out of range", "[0, 1048576]");
    expect_rejected("EPX_XN_RING_TOKENS", "16k", "not an integer", NULL);

    char long_value[1500];
    memset(long_value, 'x', sizeof(long_value) - 1);
    long_value[sizeof(long_value) - 1] = '\0';
    expect_rejected("EPX_LOG_FILE", long_value, "longer than", NULL);

    /* A rejected variable keeps its default in force; the good ones still apply. */
    unset_epx_environment();
    setenv("EPX_LOG_LEVEL", "none", 1);
    setenv("EPX_TIMEOUT_MS", "soon", 1);
    setenv("EPX_NUM_SMS", "8", 1);
    epx__params_reset();
    CHECK_STATUS(epx__params_load(), EPX_ERR_INVALID_ARG);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_TIMEOUT_MS), 30000);
    CHECK_EQ_INT(epx__param_int(EPX_PARAM_NUM_SMS), 8);
    unset_epx_environment();
    epx__clear_error();
}

static void test_unknown_and_changed_are_logged(void)
{
    const char *dir = make_scratch_dir();
    char log_path[256];
    snprintf(log_path, sizeof(log_path), "%s/params.log", dir);

    unset_epx_environment();
    setenv("EPX_LOG_FILE", log_path, 1);
    setenv("EPX_LOG_LEVEL", "info", 1);
    setenv("EPX_TIMEOUT_MS", "5000", 1);
    setenv("EPX_FOO", "1", 1);
    setenv("EPX_TIMEOUT_M", "5", 1);
    epx__params_reset();
    CHECK_OK(epx__params_load()); /* unknown names warn; they do not fail */
    CHECK_OK(epx__params_load()); /* and they warn once per reading of the environment */

    char *text = read_text_file(log_path);
    CHECK_EQ_INT(count_occurrences(text, "unknown variable EPX_FOO ignored"), 1);
    CHECK_EQ_INT(count_occurrences(text, "unknown variable EPX_TIMEOUT_M ignored; did you "
                                         "mean EPX_TIMEOUT_MS?"), 1);
    CHECK_EQ_INT(count_occurrences(text, "EPX_TIMEOUT_MS=5000 (default 30000)"), 1);
    CHECK_EQ_INT(count_occurrences(text, "EPX_LOG_LEVEL=info (default warn)"), 1);
    CHECK(count_occurrences(text, " WARN core ") >= 2);
    CHECK(count_occurrences(text, " INFO core ") >= 2);
    /* Variables left at their defaults are not reported. */
    CHECK_EQ_INT(count_occurrences(text, "EPX_NUM_SMS"), 0);
    free(text);

    /* Several bad values: the first is the error, the others are warned about. */
    char second_path[256];
    snprintf(second_path, sizeof(second_path), "%s/bad.log", dir);
    unset_epx_environment();
    setenv("EPX_LOG_FILE", second_path, 1);
    setenv("EPX_TIMEOUT_MS", "x", 1);
    setenv("EPX_NUM_SMS", "y", 1);
    epx__params_reset();
    CHECK_STATUS(epx__params_load(), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_TIMEOUT_MS=x");
    text = read_text_file(second_path);
    CHECK_EQ_INT(count_occurrences(text, "EPX_TIMEOUT_MS=x is not an integer"), 1);
    CHECK_EQ_INT(count_occurrences(text, "EPX_NUM_SMS=y is not an integer"), 1);
    free(text);

    unset_epx_environment();
    remove(log_path);
    remove(second_path);
    rmdir(dir);
    epx__clear_error();
}

/* The column where `word` starts in the header line. */
static long column_of(const char *header, const char *word)
{
    const char *at = strstr(header, word);
    CHECK(at != NULL);
    return at - header;
}

static void test_print(void)
{
    unset_epx_environment();
    setenv("EPX_LOG_LEVEL", "none", 1);
    setenv("EPX_TIMEOUT_MS", "5000", 1);
    setenv("EPX_NUM_SMS", "many", 1);
    epx__params_reset();

    char *table = NULL;
    size_t table_size = 0;
    FILE *out = open_memstream(&table, &table_size);
    CHECK(out != NULL);
    epx__params_print(out);
    CHECK(fclose(out) == 0);

    CHECK(strncmp(table, "NAME", 4) == 0);
    long type_column = column_of(table, "TYPE");
    long default_column = column_of(table, "DEFAULT");
    long value_column = column_of(table, "VALUE");
    long doc_column = column_of(table, "DESCRIPTION");

    /* Every row of the table has its fields in the header's columns. */
    int rows = 0;
    for (char *line = strchr(table, '\n') + 1; strncmp(line, "EPX_", 4) == 0;
         line = strchr(line, '\n') + 1) {
        rows++;
        CHECK(strncmp(line + type_column, "int ", 4) == 0 ||
              strncmp(line + type_column, "string ", 7) == 0);
        CHECK(line[default_column - 1] == ' ' && line[default_column] != ' ');
        CHECK(line[value_column - 1] == ' ' && line[value_column] != ' ');
        CHECK(line[doc_column - 1] == ' ' && line[doc_column] != ' ');
        if (strncmp(line, "EPX_TIMEOUT_MS ", 15) == 0) {
            CHECK(strncmp(line + default_column, "30000 ", 6) == 0);
            CHECK(strncmp(line + value_column, "5000 * ", 7) == 0);
            CHECK(strncmp(line + doc_column, "Longest wait", 12) == 0);
        }
        if (strncmp(line, "EPX_NUM_SMS ", 12) == 0)
            CHECK(strncmp(line + value_column, "16 ! ", 5) == 0);
        if (strncmp(line, "EPX_LOG_FILE ", 13) == 0)
            CHECK(strncmp(line + default_column, "\"\" ", 3) == 0);
    }
    CHECK_EQ_INT(rows, EPX_PARAM_COUNT_);
    CHECK(strstr(table, "* set from the environment") != NULL);
    CHECK(strstr(table, "! rejected, default in force: EPX_NUM_SMS=many is not an integer") !=
          NULL);
    free(table);
    unset_epx_environment();
}

static void *load_and_read(void *argument)
{
    int64_t *seen = argument;
    if (epx__params_load() != EPX_SUCCESS)
        return NULL;
    *seen = epx__param_int(EPX_PARAM_TIMEOUT_MS);
    return argument;
}

/* Threads racing to the first load all see the environment's value, never a default. */
static void test_concurrent_first_load(void)
{
    enum { THREADS = 8 };
    for (int round = 0; round < 20; round++) {
        unset_epx_environment();
        setenv("EPX_TIMEOUT_MS", "1234", 1);
        epx__params_reset();
        pthread_t threads[THREADS];
        int64_t seen[THREADS] = {0};
        for (int t = 0; t < THREADS; t++)
            CHECK(pthread_create(&threads[t], NULL, load_and_read, &seen[t]) == 0);
        for (int t = 0; t < THREADS; t++) {
            void *result = NULL;
            CHECK(pthread_join(threads[t], &result) == 0);
            CHECK(result == &seen[t]);
            CHECK_EQ_INT(seen[t], 1234);
        }
    }
    unset_epx_environment();
}

int main(void)
{
    test_defaults();
    test_overrides();
    test_bad_values();
    test_unknown_and_changed_are_logged();
    test_print();
    test_concurrent_first_load();
    printf("test_params: ok\n");
    return 0;
}
