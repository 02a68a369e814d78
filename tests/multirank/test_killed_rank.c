/*
 * A rank that dies or stops answering: the others get an error naming it, not a hang.
 *
 *   test_killed_rank [--variant kill|sleep|all] [--backend host|cuda|auto]
 *                    [--ranks-per-node P]
 *
 * The program is its own launcher: it starts 4 ranks (fork + exec of itself with
 * --child, so each rank reads its environment fresh, as under `epx launch`) and watches
 * them from outside. Every rank does one good dispatch + combine; then
 *   kill:  rank 2 SIGKILLs itself; ranks 0, 1, 3 must get EPX_ERR_REMOTE or
 *          EPX_ERR_TIMEOUT naming rank 2 from their next dispatch, within 30 s;
 *   sleep: rank 3 stays alive but does not call dispatch; the others must get
 *          EPX_ERR_TIMEOUT naming rank 3 within about twice the timeout.
 * The survivors then destroy their objects and exit 0; the parent checks every exit
 * status and that no /dev/shm/epx-* segment is left behind. With --ranks-per-node 2 the
 * ranks form two virtual nodes {0, 1} and {2, 3} (EPX_RANKS_PER_NODE): the killed and
 * the silent rank are in the node of the other's survivors, so ranks 0 and 1 learn of a
 * failure in another node.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "mem.h"
#include "moe_case.h"
#include "test_util.h"

#define NUM_RANKS 4
#define TIMEOUT_MS 3000
#define KILLED_RANK 2
#define SLEEPING_RANK 3

/* ---------------------------------------------------------------- child (one rank) */

static void rank_log(int rank, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void rank_log(int rank, const char *fmt, ...)
{
    va_list args;
    printf("[rank %d] ", rank);
    va_start(args, fmt);
    vprintf(fmt, args);
    va_end(args);
    printf("\n");
    fflush(stdout);
}

/* One good dispatch + combine, checked against the oracle, so the failure comes later. */
static void good_round(epx_buffer_t buffer, const moe_case_t *c, int rank)
{
    moe_inputs_t in;
    moe_expected_t e;
    uint16_t *want;
    CHECK_EQ_INT(moe_inputs_make(c, rank, &in), 0);
    CHECK_EQ_INT(moe_oracle_dispatch(c, rank, &e), 0);
    CHECK_EQ_INT(moe_oracle_combine(c, rank, &want), 0);
    int64_t n = in.num_tokens, h = c->hidden;
    int k = c->num_topk;
    void *x = mr_mem_from_host(in.x, (size_t)(n * h) * 2);
    void *idx = mr_mem_from_host(in.topk_idx, (size_t)(n * k) * 8);

    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, n, h);
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, n, k);
    CHECK_OK(epx_dispatch(buffer, &args, &res, NULL));
    CHECK_EQ_INT(res.num_recv_tokens, e.num_recv);

    uint16_t *rows = calloc((size_t)(e.num_recv * h) + 1, 2);
    uint16_t *got = calloc((size_t)(n * h) + 1, 2);
    CHECK(rows != NULL && got != NULL);
    for (int64_t i = 0; i < e.num_recv; i++)
        moe_combine_row(c, rank, e.recv_src_rank[i], e.recv_src_token[i], rows + i * h);
    void *combine_x = mr_mem_from_host(rows, (size_t)(e.num_recv * h) * 2);
    void *out_x = mr_mem_alloc((size_t)(n * h) * 2, 0xff);
    epx_combine_args_t cargs = EPX_COMBINE_ARGS_INIT;
    cargs.handle = res.handle;
    cargs.x = epx_tensor_2d(combine_x, EPX_DTYPE_BF16, e.num_recv, h);
    cargs.out_x = epx_tensor_2d(out_x, EPX_DTYPE_BF16, n, h);
    CHECK_OK(epx_combine(buffer, &cargs, NULL));
    mr_mem_to_host(got, out_x, (size_t)(n * h) * 2);
    for (int64_t i = 0; i < n * h; i++)
        if (mr_bf16_ulps(got[i], want[i]) != 0)
            TEST_FAIL("rank %d: good round combine out_x[%lld] is 0x%04x, expected 0x%04x", rank,
                      (long long)i, got[i], want[i]);

    CHECK_OK(epx_handle_destroy(res.handle));
    mr_mem_free(x);
    mr_mem_free(idx);
    mr_mem_free(combine_x);
    mr_mem_free(out_x);
    free(rows);
    free(got);
    free(want);
    moe_expected_free(&e);
    moe_inputs_free(&in);
}

/* The dispatch after the failure must fail in time, with an error naming rank `culprit`. */
static void failing_dispatch(epx_buffer_t buffer, const moe_case_t *c, int rank,
                             const char *variant, int allow_remote, int culprit,
                             double min_ms, double max_ms)
{
    moe_inputs_t in;
    CHECK_EQ_INT(moe_inputs_make(c, rank, &in), 0);
    void *x = mr_mem_from_host(in.x, (size_t)(in.num_tokens * c->hidden) * 2);
    void *idx = mr_mem_from_host(in.topk_idx, (size_t)(in.num_tokens * c->num_topk) * 8);
    epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
    epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
    args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, in.num_tokens, c->hidden);
    args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, in.num_tokens, c->num_topk);

    double start = mr_now_ms();
    epx_status_t status = epx_dispatch(buffer, &args, &res, NULL);
    double elapsed = mr_now_ms() - start;
    rank_log(rank, "%s: dispatch failed after %.0f ms: %s", variant, elapsed, epx_last_error());
    if (status != EPX_ERR_TIMEOUT && !(allow_remote && status == EPX_ERR_REMOTE))
        TEST_FAIL("rank %d (%s): dispatch returned %s, expected %s (last error: %s)", rank,
                  variant, epx_status_name(status),
                  allow_remote ? "EPX_ERR_REMOTE or EPX_ERR_TIMEOUT" : "EPX_ERR_TIMEOUT",
                  epx_last_error());
    if (!mr_message_names_rank(epx_last_error(), culprit))
        TEST_FAIL("rank %d (%s): the error \"%s\" does not name rank %d", rank, variant,
                  epx_last_error(), culprit);
    if (elapsed < min_ms || elapsed > max_ms)
        TEST_FAIL("rank %d (%s): the error took %.0f ms, expected %.0f..%.0f ms", rank, variant,
                  elapsed, min_ms, max_ms);
    CHECK(res.handle == NULL);
    mr_mem_free(x);
    mr_mem_free(idx);
    moe_inputs_free(&in);
}

static int run_child(int argc, char **argv, const char *variant)
{
    /* Whatever goes wrong, this rank ends: a hang becomes a failure the parent sees. */
    alarm(60);
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx_group_t group = mr_group_create(argc, argv, &info);
    int rank = info.rank;
    moe_case_t c = {NUM_RANKS, 48, 256, 4 * NUM_RANKS, 4, EPX_DTYPE_BF16, 1, 77,
                    MOE_ROUTING_RANDOM, 0.0, -1, info.ranks_per_node, 0, 0};
    CHECK_EQ_INT(info.world_size, NUM_RANKS);
    int per_node = atoi(mr_flag(argc, argv, "--ranks-per-node", "0"));
    CHECK_EQ_INT(info.ranks_per_node, per_node > 0 ? per_node : NUM_RANKS);
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = c.num_tokens;
    config.hidden = c.hidden;
    config.num_experts = c.num_experts;
    config.num_topk = c.num_topk;
    epx_buffer_t buffer;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    good_round(buffer, &c, rank);
    rank_log(rank, "%s: good round ok", variant);

    c.seed++;
    if (strcmp(variant, "kill") == 0) {
        if (rank == KILLED_RANK)
            raise(SIGKILL);
        failing_dispatch(buffer, &c, rank, variant, 1, KILLED_RANK, 0, 30000);
    } else if (rank == SLEEPING_RANK) {
        /* Alive but silent until the others have given up on this rank. */
        sleep(2 * TIMEOUT_MS / 1000 + 3);
        double start = mr_now_ms();
        epx_dispatch_args_t args = EPX_DISPATCH_ARGS_INIT;
        epx_dispatch_result_t res = EPX_DISPATCH_RESULT_INIT;
        moe_inputs_t in;
        CHECK_EQ_INT(moe_inputs_make(&c, rank, &in), 0);
        void *x = mr_mem_from_host(in.x, (size_t)(in.num_tokens * c.hidden) * 2);
        void *idx = mr_mem_from_host(in.topk_idx, (size_t)(in.num_tokens * c.num_topk) * 8);
        args.x = epx_tensor_2d(x, EPX_DTYPE_BF16, in.num_tokens, c.hidden);
        args.topk_idx = epx_tensor_2d(idx, EPX_DTYPE_INT64, in.num_tokens, c.num_topk);
        /* The peers gave up and left: this rank must learn it, not wait forever. */
        epx_status_t status = epx_dispatch(buffer, &args, &res, NULL);
        if (status == EPX_SUCCESS && mr_mem_is_device()) {
            /* The CUDA dispatch returns once the counts are in (they were: the peers had
             * published theirs before giving up); the data kernel then sees the peers'
             * abort words and stops, which surfaces as the async error. */
            mr_mem_sync();
            epx_status_t async = EPX_SUCCESS;
            char message[512] = "";
            CHECK_OK(epx_get_async_error(buffer, &async, message, sizeof message));
            status = async;
            rank_log(rank, "%s: late dispatch async error: %s", variant, message);
        }
        double elapsed = mr_now_ms() - start;
        rank_log(rank, "%s: late dispatch returned after %.0f ms: %s", variant, elapsed,
                 epx_last_error());
        if (status == EPX_SUCCESS)
            TEST_FAIL("rank %d: dispatch after the peers gave up succeeded", rank);
        if (elapsed > 2.0 * TIMEOUT_MS + 2000)
            TEST_FAIL("rank %d: late dispatch took %.0f ms", rank, elapsed);
        mr_mem_free(x);
        mr_mem_free(idx);
        moe_inputs_free(&in);
    } else {
        failing_dispatch(buffer, &c, rank, variant, 0, SLEEPING_RANK, 0.5 * TIMEOUT_MS,
                         2.0 * TIMEOUT_MS + 2000);
    }
    CHECK_OK(epx_buffer_destroy(buffer));
    CHECK_OK(epx_group_destroy(group));
    rank_log(rank, "%s: destroyed cleanly", variant);
    return 0;
}

/* ---------------------------------------------------------------- parent */

/* Every rank this program started (both variants): their segments must be gone. */
static pid_t started[2 * NUM_RANKS];
static int num_started;

/*
 * Names of the /dev/shm segments that ranks started here created and left ("epx-PID-..."
 * with PID one of theirs; other tests running at the same time have their own), one
 * string with '\n' after each. Returns how many.
 */
static int leftover_segments(char *names, size_t size)
{
    size_t used = 0;
    int count = 0;
    names[0] = '\0';
    DIR *dir = opendir("/dev/shm");
    if (dir == NULL)
        return 0;
    for (struct dirent *entry = readdir(dir); entry != NULL; entry = readdir(dir))
        for (int i = 0; i < num_started; i++) {
            char prefix[48];
            snprintf(prefix, sizeof prefix, "epx-%ld-", (long)started[i]);
            if (strncmp(entry->d_name, prefix, strlen(prefix)) != 0)
                continue;
            count++;
            if (used + strlen(entry->d_name) + 2 < size)
                used += (size_t)snprintf(names + used, size - used, "%s\n", entry->d_name);
        }
    closedir(dir);
    return count;
}

/*
 * Start the 4 ranks of one variant (in nodes of `per_node` ranks, 0 = one node) and
 * check how each ended. Returns 0 if all is right.
 */
static int run_variant(const char *variant, const char *backend, int per_node)
{
    epx_unique_id_t id;
    char id_text[2 * EPX_UNIQUE_ID_BYTES + 64];
    CHECK_OK(epx_get_unique_id(&id));
    CHECK_OK(epx_unique_id_to_string(&id, id_text, sizeof id_text));

    pid_t pids[NUM_RANKS];
    for (int r = 0; r < NUM_RANKS; r++) {
        pids[r] = fork();
        if (pids[r] < 0)
            TEST_FAIL("fork: %s", strerror(errno));
        if (pids[r] > 0)
            started[num_started++] = pids[r];
        if (pids[r] == 0) {
            char timeout_text[16], per_node_text[16];
            snprintf(timeout_text, sizeof timeout_text, "%d", TIMEOUT_MS);
            snprintf(per_node_text, sizeof per_node_text, "%d", per_node);
            mr_set_rank_env(r, NUM_RANKS, id_text);
            if (per_node > 0)
                setenv("EPX_RANKS_PER_NODE", per_node_text, 1);
            setenv("EPX_TIMEOUT_MS", timeout_text, 1);
            char *child_argv[] = {"test_killed_rank", "--child", (char *)variant, "--backend",
                                  (char *)backend, "--ranks-per-node", per_node_text, NULL};
            execv("/proc/self/exe", child_argv);
            fprintf(stderr, "exec of /proc/self/exe failed: %s\n", strerror(errno));
            _exit(127);
        }
    }

    int failures = 0, status[NUM_RANKS], done = 0;
    int finished[NUM_RANKS] = {0};
    double deadline = mr_now_ms() + 90000;
    while (done < NUM_RANKS) {
        for (int r = 0; r < NUM_RANKS; r++)
            if (!finished[r] && waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
                finished[r] = 1;
                done++;
            }
        if (done < NUM_RANKS && mr_now_ms() > deadline) {
            for (int r = 0; r < NUM_RANKS; r++)
                if (!finished[r]) {
                    fprintf(stderr, "FAIL %s: rank %d still running after 90 s; killing it\n",
                            variant, r);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], &status[r], 0);
                    finished[r] = 1;
                    done++;
                    failures++;
                }
        }
        usleep(20000);
    }

    for (int r = 0; r < NUM_RANKS; r++) {
        int killed_here = strcmp(variant, "kill") == 0 && r == KILLED_RANK;
        int ok = killed_here ? WIFSIGNALED(status[r]) && WTERMSIG(status[r]) == SIGKILL
                             : WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0;
        if (!ok) {
            failures++;
            if (WIFSIGNALED(status[r]))
                fprintf(stderr, "FAIL %s: rank %d ended by signal %d\n", variant, r,
                        WTERMSIG(status[r]));
            else
                fprintf(stderr, "FAIL %s: rank %d exited with status %d, expected %s\n",
                        variant, r, WEXITSTATUS(status[r]), killed_here ? "SIGKILL" : "0");
        }
    }
    return failures;
}

int main(int argc, char **argv)
{
    const char *child = mr_flag(argc, argv, "--child", NULL);
    if (child != NULL)
        return run_child(argc, argv, child);

    const char *variant = mr_flag(argc, argv, "--variant", "all");
    const char *backend = mr_flag(argc, argv, "--backend", "auto");
    int per_node = atoi(mr_flag(argc, argv, "--ranks-per-node", "0"));
    if (per_node < 0 || (per_node > 0 && NUM_RANKS % per_node != 0))
        TEST_FAIL("--ranks-per-node %d: expected 0 (one node) or a divisor of %d", per_node,
                  NUM_RANKS);
    if (strcmp(variant, "all") != 0 && strcmp(variant, "kill") != 0 &&
        strcmp(variant, "sleep") != 0)
        TEST_FAIL("--variant %s: expected kill, sleep or all", variant);

    static char leaked[1 << 16];
    int failures = 0;
    if (strcmp(variant, "all") == 0 || strcmp(variant, "kill") == 0)
        failures += run_variant("kill", backend, per_node);
    if (strcmp(variant, "all") == 0 || strcmp(variant, "sleep") == 0)
        failures += run_variant("sleep", backend, per_node);

    /* A segment may take a moment to go after its rank exits; a leak stays. */
    if (leftover_segments(leaked, sizeof leaked) > 0) {
        sleep(2);
        if (leftover_segments(leaked, sizeof leaked) > 0) {
            fprintf(stderr, "FAIL: segments left in /dev/shm:\n%s", leaked);
            failures++;
        }
    }
    if (failures > 0)
        return 1;
    printf("test_killed_rank: %s ok (%d node(s))\n", variant,
           per_node > 0 ? NUM_RANKS / per_node : 1);
    return 0;
}
