/*
 * Status codes, the last-error text, EPX_CHECK unwinding, the version.
 */
#include <pthread.h>
#include <string.h>

#include "core/core.h"
#include "test_util.h"

static const struct {
    epx_status_t status;
    const char *name;
} expected_names[] = {
#define EXPECTED_NAME_(name, value, text) {EPX_##name, "EPX_" #name},
    EPX_STATUS_MAP(EXPECTED_NAME_)
#undef EXPECTED_NAME_
};
#define STATUS_COUNT ((int)(sizeof(expected_names) / sizeof(expected_names[0])))

static void test_names_and_strings(void)
{
    CHECK_EQ_INT(STATUS_COUNT, 13);
    for (int i = 0; i < STATUS_COUNT; i++) {
        epx_status_t status = expected_names[i].status;
        CHECK(strcmp(epx_status_name(status), expected_names[i].name) == 0);
        const char *text = epx_status_string(status);
        CHECK(text != NULL && text[0] != '\0');
        CHECK(strcmp(text, "unknown status") != 0);
        for (int j = 0; j < i; j++) {
            CHECK(strcmp(text, epx_status_string(expected_names[j].status)) != 0);
            CHECK(strcmp(epx_status_name(status), epx_status_name(expected_names[j].status)) != 0);
        }
    }
    CHECK(strcmp(epx_status_string(EPX_SUCCESS), "success") == 0);
    CHECK(strcmp(epx_status_string(EPX_ERR_TIMEOUT),
                 "a peer rank did not answer within the timeout") == 0);
    CHECK(strcmp(epx_status_name(EPX_ERR_REMOTE), "EPX_ERR_REMOTE") == 0);
    CHECK_EQ_INT(EPX_ERR_INTERNAL, 12);

    CHECK(strcmp(epx_status_string((epx_status_t)999), "unknown status") == 0);
    CHECK(strcmp(epx_status_name((epx_status_t)999), "EPX_UNKNOWN_STATUS") == 0);
    CHECK(strcmp(epx_status_name((epx_status_t)-1), "EPX_UNKNOWN_STATUS") == 0);
}

static void test_version(void)
{
    CHECK_EQ_INT(epx_version(), EPX_VERSION_CODE);
    CHECK_EQ_INT(epx_version(), EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 +
                                    EPX_VERSION_PATCH);
}

static void test_last_error(void)
{
    epx__clear_error();
    CHECK(strcmp(epx_last_error(), "") == 0);

    epx_status_t status = EPX_ERROR(EPX_ERR_TIMEOUT, "rank %d did not answer in %s", 3, "dispatch");
    CHECK_EQ_INT(status, EPX_ERR_TIMEOUT);
    CHECK(strcmp(epx_last_error(), "rank 3 did not answer in dispatch") == 0);

    /* A later error replaces the text; clearing empties it. */
    CHECK_EQ_INT(EPX_ERROR(EPX_ERR_CAPACITY, "second"), EPX_ERR_CAPACITY);
    CHECK(strcmp(epx_last_error(), "second") == 0);
    epx__clear_error();
    CHECK(strcmp(epx_last_error(), "") == 0);

    /* A message longer than the buffer is cut and marked as cut. */
    char long_text[3000];
    memset(long_text, 'a', sizeof(long_text) - 1);
    long_text[sizeof(long_text) - 1] = '\0';
    EPX_ERROR(EPX_ERR_INVALID_ARG, "%s", long_text);
    size_t length = strlen(epx_last_error());
    CHECK(length >= 512 && length < 2048);
    CHECK(strcmp(epx_last_error() + length - 3, "...") == 0);
    epx__clear_error();
}

static void *set_error_in_thread(void *argument)
{
    char *seen_at_start = argument;
    snprintf(seen_at_start, 64, "%s", epx_last_error());
    EPX_ERROR(EPX_ERR_SYSTEM, "thread error");
    return strcmp(epx_last_error(), "thread error") == 0 ? argument : NULL;
}

static void test_last_error_is_per_thread(void)
{
    EPX_ERROR(EPX_ERR_BOOTSTRAP, "main thread error");
    pthread_t thread;
    char seen_at_start[64];
    CHECK(pthread_create(&thread, NULL, set_error_in_thread, seen_at_start) == 0);
    void *result = NULL;
    CHECK(pthread_join(thread, &result) == 0);
    CHECK(result == seen_at_start);
    CHECK(strcmp(seen_at_start, "") == 0);
    CHECK(strcmp(epx_last_error(), "main thread error") == 0);
    epx__clear_error();
}

/* EPX_CHECK returns the callee's status; EPX_CHECK_GOTO unwinds through a label. */
static int steps_undone;

static epx_status_t fail_with(epx_status_t status)
{
    return status == EPX_SUCCESS ? EPX_SUCCESS : EPX_ERROR(status, "step failed");
}

static epx_status_t two_steps(epx_status_t first, epx_status_t second, int *reached_end)
{
    *reached_end = 0;
    EPX_CHECK(fail_with(first));
    epx_status_t status;
    EPX_CHECK_GOTO(fail_with(second), status, err_undo_first);
    *reached_end = 1;
    return EPX_SUCCESS;
err_undo_first:
    steps_undone++;
    return status;
}

static void test_check_macros(void)
{
    int reached_end;
    steps_undone = 0;
    CHECK_OK(two_steps(EPX_SUCCESS, EPX_SUCCESS, &reached_end));
    CHECK_EQ_INT(reached_end, 1);
    CHECK_EQ_INT(steps_undone, 0);

    CHECK_STATUS(two_steps(EPX_ERR_CUDA, EPX_SUCCESS, &reached_end), EPX_ERR_CUDA);
    CHECK_EQ_INT(reached_end, 0);
    CHECK_EQ_INT(steps_undone, 0);

    CHECK_STATUS(two_steps(EPX_SUCCESS, EPX_ERR_REMOTE, &reached_end), EPX_ERR_REMOTE);
    CHECK_EQ_INT(reached_end, 0);
    CHECK_EQ_INT(steps_undone, 1);
    CHECK(strcmp(epx_last_error(), "step failed") == 0);
    epx__clear_error();
}

int main(void)
{
    test_names_and_strings();
    test_version();
    test_last_error();
    test_last_error_is_per_thread();
    test_check_macros();
    printf("test_status: ok\n");
    return 0;
}
