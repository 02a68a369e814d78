/*
 * A rank lost in the middle of low-latency serving (include/epx.h, "Failed peers"): the
 * survivors' failed wait returns EPX_ERR_REMOTE or EPX_ERR_TIMEOUT naming the rank, and
 * the step still completes with the others: its results are written, its handle stays
 * valid, the rank is masked, and the next steps run without it. Results are checked
 * against the oracle (tests/common/moe_ll.h) with the lost rank masked.
 *
 *   test_ll_fault [--variant dispatch|combine|stop|all]
 *
 * Its own launcher (as test_killed_rank), 4 ranks on the CPU backend, rank 3 lost:
 *   dispatch: rank 3 is SIGKILLed before step 1's dispatch;
 *   combine:  rank 3 is SIGKILLed after step 1's dispatch, before its combine;
 *   stop:     rank 3 stops answering (sleeps past the timeout) before step 1's dispatch.
 * Every survivor then runs two more steps and checks them.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ll_step.h"
#include "test_util.h"

#define NUM_RANKS 4
#define LOST 3
#define TIMEOUT_MS 2000
#define MAX_TOKENS 8
#define EXPERTS_PER_RANK 3
#define TOPK 4
#define HIDDEN 128

static epx_group_info_t info = EPX_GROUP_INFO_INIT;
static const ll_shape_t shape = {NUM_RANKS, EXPERTS_PER_RANK, TOPK, HIDDEN, MAX_TOKENS};

/* A failed wait: the right class, naming the lost rank, in time. */
static void check_peer_failure(epx_status_t status, double elapsed_ms, const char *what,
                               int stopped)
{
    if (status != EPX_ERR_REMOTE && status != EPX_ERR_TIMEOUT)
        TEST_FAIL("rank %d %s: returned %s (%s), expected a peer failure naming rank %d",
                  info.rank, what, epx_status_name(status), epx_last_error(), LOST);
    if (!mr_message_names_rank(epx_last_error(), LOST))
        TEST_FAIL("rank %d %s: \"%s\" does not name rank %d", info.rank, what, epx_last_error(),
                  LOST);
    double limit = stopped ? 2.0 * TIMEOUT_MS + 2000 : 2000;
    if (elapsed_ms > limit)
        TEST_FAIL("rank %d %s: detection took %.0f ms (limit %.0f)", info.rank, what, elapsed_ms,
                  limit);
    printf("[rank %d] %s: %s after %.0f ms: %s\n", info.rank, what, epx_status_name(status),
           elapsed_ms, epx_last_error());
    fflush(stdout);
}

static void check_masked_query(epx_buffer_t buffer)
{
    int32_t mask[NUM_RANKS];
    CHECK_OK(epx_ll_get_masked(buffer, mask, NUM_RANKS));
    for (int r = 0; r < NUM_RANKS; r++)
        if (mask[r] != (r == LOST))
            TEST_FAIL("rank %d: epx_ll_get_masked says rank %d is %smasked", info.rank, r,
                      mask[r] ? "" : "not ");
    /* The failure is reported as the buffer's asynchronous error too, and poisons nothing. */
    epx_status_t error = EPX_SUCCESS;
    char message[512];
    CHECK_OK(epx_get_async_error(buffer, &error, message, sizeof message));
    if ((error != EPX_ERR_REMOTE && error != EPX_ERR_TIMEOUT) ||
        !mr_message_names_rank(message, LOST))
        TEST_FAIL("rank %d: async error %s \"%s\", expected the loss of rank %d", info.rank,
                  epx_status_name(error), message, LOST);
}

static int run_child(int argc, char **argv, const char *variant)
{
    alarm(60);
    epx_group_t group = mr_group_create(argc, argv, &info);
    CHECK_EQ_INT(info.world_size, NUM_RANKS);
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = MAX_TOKENS;
    config.hidden = HIDDEN;
    config.num_experts = EXPERTS_PER_RANK * NUM_RANKS;
    config.num_topk = TOPK;
    config.max_low_latency_tokens = MAX_TOKENS;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    uint8_t mask[NUM_RANKS] = {0};
    mask[LOST] = 1;

    /* Step 0: everyone. */
    ll_step_run_checked(buffer, &shape, info.rank, 10, NULL, 0, "step 0");

    /* Step 1: rank 3 is lost before its dispatch or before its combine. */
    int kill_first = strcmp(variant, "combine") != 0;
    int stopped = strcmp(variant, "stop") == 0;
    if (info.rank == LOST && kill_first) {
        if (stopped) {
            sleep(2 * TIMEOUT_MS / 1000 + 4); /* alive, silent, past every survivor's wait */
            _exit(0);
        }
        raise(SIGKILL);
    }
    ll_step_t s;
    ll_step_init(&s, &shape, info.rank, 11);
    /* Rows sent to rank 3 before its loss was known are not counted as masked. */
    s.check_dispatch_masked = !kill_first;
    double start = mr_now_ms();
    epx_status_t status = ll_step_dispatch(buffer, &s, 0);
    double elapsed = mr_now_ms() - start;
    if (kill_first) {
        check_peer_failure(status, elapsed, "step 1 dispatch", stopped);
        check_masked_query(buffer);
    } else {
        CHECK_OK(status);
        if (info.rank == LOST)
            raise(SIGKILL);
    }
    /* Written all the same: rank 3's rows are absent, the others are all there. */
    ll_step_check_dispatch(&s, kill_first ? mask : NULL, "step 1 dispatch");
    start = mr_now_ms();
    status = ll_step_combine(buffer, &s, 0);
    elapsed = mr_now_ms() - start;
    if (kill_first) {
        CHECK_OK(status); /* rank 3 was masked by the failed dispatch */
    } else {
        check_peer_failure(status, elapsed, "step 1 combine", 0);
        check_masked_query(buffer);
    }
    ll_step_check_combine(&s, mask, "step 1 combine");
    /* The handle stayed valid: the step can be combined again, with the same result. */
    memset(s.out, 0xff, (size_t)(MAX_TOKENS * HIDDEN) * 2);
    CHECK_OK(ll_step_combine(buffer, &s, 0));
    ll_step_check_combine(&s, mask, "step 1 combined again");
    ll_step_free(&s);

    /* Steps 2 and 3: serving goes on without rank 3. */
    for (int i = 2; i < 4; i++) {
        char what[32];
        snprintf(what, sizeof what, "step %d", i);
        ll_step_run_checked(buffer, &shape, info.rank, 10 + (uint64_t)i, mask, 0, what);
    }
    check_masked_query(buffer);
    /* The destroy's vote cannot include rank 3: it may report that, and frees anyway. */
    epx_status_t destroyed = epx_buffer_destroy(buffer);
    CHECK(destroyed == EPX_SUCCESS || destroyed == EPX_ERR_BOOTSTRAP ||
          destroyed == EPX_ERR_REMOTE || destroyed == EPX_ERR_TIMEOUT);
    CHECK_STATUS(epx_buffer_destroy(buffer), EPX_ERR_INVALID_ARG); /* it is gone */
    epx_group_destroy(group);
    printf("[rank %d] %s: the step completed without rank %d and serving went on\n", info.rank,
           variant, LOST);
    return 0;
}

static int run_variant(const char *variant)
{
    epx_unique_id_t id;
    char id_text[2 * EPX_UNIQUE_ID_BYTES + 64];
    CHECK_OK(epx_get_unique_id(&id));
    CHECK_OK(epx_unique_id_to_string(&id, id_text, sizeof id_text));
    pid_t pids[NUM_RANKS];
    for (int r = 0; r < NUM_RANKS; r++) {
        fflush(stdout);
        pids[r] = fork();
        if (pids[r] < 0)
            TEST_FAIL("fork: %s", strerror(errno));
        if (pids[r] == 0) {
            char timeout_text[16];
            snprintf(timeout_text, sizeof timeout_text, "%d", TIMEOUT_MS);
            mr_set_rank_env(r, NUM_RANKS, id_text);
            setenv("EPX_TIMEOUT_MS", timeout_text, 1);
            setenv("EPX_LOG_LEVEL", "error", 1);
            char *child_argv[] = {"test_ll_fault", "--child", (char *)variant, "--backend",
                                  "host", NULL};
            execv("/proc/self/exe", child_argv);
            _exit(127);
        }
    }
    int failures = 0;
    for (int r = 0; r < NUM_RANKS; r++) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        int lost_ok = r == LOST && ((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ||
                                    (WIFEXITED(status) && WEXITSTATUS(status) == 0));
        if (!lost_ok && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            failures++;
            fprintf(stderr, "FAIL %s: rank %d ended with %s %d\n", variant, r,
                    WIFSIGNALED(status) ? "signal" : "status",
                    WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
        }
    }
    printf("%s %s\n", failures ? "FAIL" : "ok  ", variant);
    return failures;
}

int main(int argc, char **argv)
{
    const char *child = mr_flag(argc, argv, "--child", NULL);
    if (child != NULL)
        return run_child(argc, argv, child);
    const char *variant = mr_flag(argc, argv, "--variant", "all");
    const char *all[] = {"dispatch", "combine", "stop"};
    int failures = 0;
    for (int i = 0; i < 3; i++)
        if (strcmp(variant, "all") == 0 || strcmp(variant, all[i]) == 0)
            failures += run_variant(all[i]);
    return failures == 0 ? 0 : 1;
}
