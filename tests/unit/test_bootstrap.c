/*
 * The TCP bootstrap and unique ids: ranks are forked processes on this machine that
 * meet through one id made by the parent.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fork_ranks.h"
#include "api.h"
#include "bootstrap/tcp_io.h"
#include "test_util.h"

#define LONG_TIMEOUT_MS 8000
#define SHORT_TIMEOUT_MS 1000

static epx_unique_id_t g_id;

static epx_unique_id_t fresh_id(void)
{
    epx_unique_id_t id;
    CHECK_OK(epx_get_unique_id(&id));
    return id;
}

static epx_group_t create_group(int rank, int world_size, int64_t timeout_ms)
{
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = world_size;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = &g_id;
    config.timeout_ms = timeout_ms;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    CHECK(group != NULL);
    return group;
}

static double elapsed_ms(int64_t start_ns)
{
    return (double)(epx__now_ns() - start_ns) / 1e6;
}

/* ---------------------------------------------------------------- a working group */

static int body_allgather(int rank, int world_size, void *arg)
{
    (void)arg;
    epx_group_t group = create_group(rank, world_size, LONG_TIMEOUT_MS);
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    CHECK_OK(epx_group_get_info(group, &info));
    CHECK_EQ_INT(info.rank, rank);
    CHECK_EQ_INT(info.world_size, world_size);
    CHECK_EQ_INT(info.backend, EPX_BACKEND_HOST);
    CHECK_EQ_INT(info.device, -1);

    /* A small block: every rank's distinct value lands at its offset. */
    int64_t mine = 1000 * (int64_t)rank + 7, all[64];
    memset(all, 0xff, sizeof(all));
    CHECK_OK(epx__bootstrap_allgather(group->bootstrap, &mine, all, sizeof(mine)));
    for (int r = 0; r < world_size; r++)
        CHECK_EQ_INT(all[r], 1000 * (int64_t)r + 7);

    for (int i = 0; i < 5; i++)
        CHECK_OK(epx_group_barrier(group));

    /* A block larger than the socket buffers, so sends and receives come in pieces. */
    size_t block = 300 * 1000 + 3;
    unsigned char *send = malloc(block), *recv = malloc(block * (size_t)world_size);
    CHECK(send != NULL && recv != NULL);
    for (size_t i = 0; i < block; i++)
        send[i] = (unsigned char)(i * 31 + (size_t)rank * 7);
    CHECK_OK(epx__bootstrap_allgather(group->bootstrap, send, recv, block));
    for (int r = 0; r < world_size; r++)
        for (size_t i = 0; i < block; i++)
            if (recv[(size_t)r * block + i] != (unsigned char)(i * 31 + (size_t)r * 7))
                TEST_FAIL("rank %d: byte %zu of rank %d's block is wrong", rank, i, r);
    free(send);
    free(recv);

    /* Exchanges stay in step after a barrier. */
    CHECK_OK(epx_group_barrier(group));
    mine = -(int64_t)rank;
    CHECK_OK(epx__bootstrap_allgather(group->bootstrap, &mine, all, sizeof(mine)));
    for (int r = 0; r < world_size; r++)
        CHECK_EQ_INT(all[r], -(int64_t)r);
    CHECK_OK(epx_group_destroy(group));
    return 0;
}

static void test_groups_of_several_sizes(void)
{
    const int sizes[] = {1, 2, 4, 8};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        g_id = fresh_id();
        if (run_ranks("allgather", sizes[i], sizes[i], body_allgather, NULL) != 0)
            TEST_FAIL("a group of %d ranks failed", sizes[i]);
    }
}

/* ---------------------------------------------------------------- missing ranks */

static int body_expect_join_timeout(int rank, int world_size, void *arg)
{
    (void)arg;
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = world_size;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = &g_id;
    config.timeout_ms = SHORT_TIMEOUT_MS;
    epx_group_t group = (epx_group_t)0x1;
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx_group_create(&config, &group), EPX_ERR_TIMEOUT);
    double took = elapsed_ms(start);
    CHECK(group == (epx_group_t)0x1); /* outputs untouched on failure */
    CHECK_ERROR_MENTIONS("rank 3");
    if (took < 0.9 * SHORT_TIMEOUT_MS || took > 2.0 * SHORT_TIMEOUT_MS + 500)
        TEST_FAIL("rank %d gave up after %.0f ms with a %d ms timeout", rank, took,
                  SHORT_TIMEOUT_MS);
    return 0;
}

static void test_rank_that_never_joins(void)
{
    g_id = fresh_id();
    /* World of 4, rank 3 never started. */
    if (run_ranks("never joins", 3, 4, body_expect_join_timeout, NULL) != 0)
        TEST_FAIL("ranks 0..2 did not all time out naming rank 3");
}

static int body_root_never_comes(int rank, int world_size, void *arg)
{
    (void)arg;
    epx__bootstrap_t *bootstrap = NULL;
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx__bootstrap_create_tcp(&g_id, rank, world_size, SHORT_TIMEOUT_MS, &bootstrap),
                 EPX_ERR_TIMEOUT);
    CHECK(bootstrap == NULL);
    CHECK_ERROR_MENTIONS("rank 0 (root)");
    CHECK(elapsed_ms(start) < 2.0 * SHORT_TIMEOUT_MS + 500);
    return 0;
}

static void test_root_that_never_comes(void)
{
    g_id = fresh_id();
    pid_t pid = fork_rank(body_root_never_comes, 1, 2, NULL);
    if (wait_rank(pid, "root never comes", 1) != 0)
        TEST_FAIL("rank 1 did not time out naming rank 0 (root)");
}

/* Rank 2 joins but is late to the allgather: the others time out naming it. */
static int body_late_to_allgather(int rank, int world_size, void *arg)
{
    (void)arg;
    epx__bootstrap_t *bootstrap = NULL;
    CHECK_OK(epx__bootstrap_create_tcp(&g_id, rank, world_size, SHORT_TIMEOUT_MS, &bootstrap));
    if (rank == 2) {
        /* Holds its connection open but says nothing until the others gave up; then
         * the root's report of why is waiting for it too. */
        usleep(1500 * 1000);
        int32_t mine = rank, all[4];
        CHECK_STATUS(epx__bootstrap_allgather(bootstrap, &mine, all, sizeof(mine)),
                     EPX_ERR_TIMEOUT);
        CHECK_ERROR_MENTIONS("rank 0 (root) reports: timed out");
        epx__bootstrap_destroy(bootstrap);
        return 0;
    }
    int32_t mine = rank, all[4];
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx__bootstrap_allgather(bootstrap, &mine, all, sizeof(mine)), EPX_ERR_TIMEOUT);
    double took = elapsed_ms(start);
    CHECK_ERROR_MENTIONS("rank 2");
    CHECK_ERROR_MENTIONS("allgather");
    if (took > 2.0 * SHORT_TIMEOUT_MS + 500)
        TEST_FAIL("rank %d gave up after %.0f ms", rank, took);
    /* The failure sticks: the ranks are out of step now. */
    CHECK_STATUS(epx__bootstrap_barrier(bootstrap), EPX_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS("earlier");
    epx__bootstrap_destroy(bootstrap);
    return 0;
}

static void test_rank_late_to_allgather(void)
{
    g_id = fresh_id();
    if (run_ranks("late to allgather", 4, 4, body_late_to_allgather, NULL) != 0)
        TEST_FAIL("ranks did not time out naming rank 2");
}

static int compare_int64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/*
 * A barrier holds every rank until the last has arrived, whoever is last, with the
 * aligned release at its default and (this binary runs again, tests/CMakeLists.txt) with
 * EPX_BARRIER_ALIGN_US at 2000 and at 0 (off):
 * each round one rank arrives 3 ms after the others, and no rank may leave before it
 * arrived (the ranks share this machine's clock). Prints how far apart the ranks left
 * (informational: with more ranks than cores, as in CI, it says little).
 */
static int body_barrier_holds(int rank, int world_size, void *arg)
{
    (void)arg;
    epx_group_t group = create_group(rank, world_size, LONG_TIMEOUT_MS);
    int64_t spreads[10];
    for (int round = 0; round < 12; round++) {
        if (rank == round % world_size)
            usleep(3000);
        int64_t arrived = epx__now_ns();
        CHECK_OK(epx_group_barrier(group));
        int64_t left = epx__now_ns();
        int64_t mine[2] = {arrived, left}, all[2 * 8];
        CHECK_OK(epx__bootstrap_allgather(group->bootstrap, mine, all, sizeof(mine)));
        int64_t first_left = INT64_MAX, last_left = 0;
        for (int r = 0; r < world_size; r++) {
            if (all[2 * r] > left)
                TEST_FAIL("round %d: rank %d left the barrier %.3f ms before rank %d arrived",
                          round, rank, (double)(all[2 * r] - left) / 1e6, r);
            first_left = all[2 * r + 1] < first_left ? all[2 * r + 1] : first_left;
            last_left = all[2 * r + 1] > last_left ? all[2 * r + 1] : last_left;
        }
        if (round >= 2)
            spreads[round - 2] = last_left - first_left;
    }
    if (rank == 0) {
        qsort(spreads, 10, sizeof(spreads[0]), compare_int64);
        printf("     barrier: leaving times spread %.1f us (median of rounds 2-11; max %.1f), "
               "EPX_BARRIER_ALIGN_US=%s\n",
               (double)(spreads[4] + spreads[5]) / 2e3, (double)spreads[9] / 1e3,
               getenv("EPX_BARRIER_ALIGN_US") ? getenv("EPX_BARRIER_ALIGN_US") : "200 (default)");
    }
    CHECK_OK(epx_group_destroy(group));
    return 0;
}

static void test_barrier_holds(void)
{
    g_id = fresh_id();
    if (run_ranks("barrier holds", 4, 4, body_barrier_holds, NULL) != 0)
        TEST_FAIL("a rank left a barrier early");
}

/* ---------------------------------------------------------------- dead ranks */

static int body_rank_exits(int rank, int world_size, void *arg)
{
    (void)arg;
    epx__bootstrap_t *bootstrap = NULL;
    CHECK_OK(epx__bootstrap_create_tcp(&g_id, rank, world_size, LONG_TIMEOUT_MS, &bootstrap));
    if (rank == 2)
        _exit(0); /* dies without a word: the kernel closes its socket */
    int32_t mine = rank, all[3];
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx__bootstrap_allgather(bootstrap, &mine, all, sizeof(mine)), EPX_ERR_REMOTE);
    CHECK_ERROR_MENTIONS("rank 2 closed its connection during allgather");
    if (rank != 0)
        CHECK_ERROR_MENTIONS("rank 0 (root) reports");
    /* Found at once, not by the (long) timeout. */
    CHECK(elapsed_ms(start) < LONG_TIMEOUT_MS / 2);
    epx__bootstrap_destroy(bootstrap);
    return 0;
}

static void test_rank_that_exits(void)
{
    g_id = fresh_id();
    if (run_ranks("rank exits", 3, 3, body_rank_exits, NULL) != 0)
        TEST_FAIL("the rank that exited was not reported as EPX_ERR_REMOTE");
}

/* ---------------------------------------------------------------- refused joins */

static epx_unique_id_t g_wrong_id;

static int body_wrong_nonce(int rank, int world_size, void *arg)
{
    (void)arg;
    epx__bootstrap_t *bootstrap = NULL;
    CHECK_STATUS(epx__bootstrap_create_tcp(&g_wrong_id, rank, world_size, LONG_TIMEOUT_MS,
                                           &bootstrap),
                 EPX_ERR_BOOTSTRAP);
    CHECK_ERROR_MENTIONS("nonce");
    return 0;
}

static void test_wrong_nonce_is_refused(void)
{
    g_id = fresh_id();
    /* Same address and port, another nonce: the last hex digit changed. */
    g_wrong_id = g_id;
    size_t last = strlen(g_wrong_id.internal) - 1;
    g_wrong_id.internal[last] = g_wrong_id.internal[last] == '0' ? '1' : '0';

    pid_t root = fork_rank(body_allgather, 0, 2, NULL);
    pid_t intruder = fork_rank(body_wrong_nonce, 1, 2, NULL);
    int failed = wait_rank(intruder, "wrong nonce", 1);
    /* The root ignored the intruder and still forms the group with the real rank 1. */
    pid_t member = fork_rank(body_allgather, 1, 2, NULL);
    failed += wait_rank(member, "after intruder", 1);
    failed += wait_rank(root, "after intruder", 0);
    if (failed != 0)
        TEST_FAIL("a wrong nonce was not refused cleanly");
}

static int body_bad_join(int rank, int world_size, void *arg)
{
    const char *needle = arg;
    epx__bootstrap_t *bootstrap = NULL;
    CHECK_STATUS(epx__bootstrap_create_tcp(&g_id, rank, world_size, LONG_TIMEOUT_MS, &bootstrap),
                 EPX_ERR_BOOTSTRAP);
    CHECK_ERROR_MENTIONS(needle);
    return 0;
}

static void test_bad_joins_are_refused(void)
{
    /* Rank 1 believes the world has 3 ranks, the root 2: both fail, naming it. */
    g_id = fresh_id();
    pid_t root = fork_rank(body_bad_join, 0, 2, "world size 3");
    pid_t member = fork_rank(body_bad_join, 1, 3, "world size 3");
    int failed = wait_rank(root, "world size", 0) + wait_rank(member, "world size", 1);

    /* Two processes claim rank 1: everyone fails, naming the duplicate. */
    g_id = fresh_id();
    pid_t pids[3] = {fork_rank(body_bad_join, 0, 3, "two processes joined as rank 1"),
                     fork_rank(body_bad_join, 1, 3, "two processes joined as rank 1"),
                     fork_rank(body_bad_join, 1, 3, "two processes joined as rank 1")};
    for (int i = 0; i < 3; i++)
        failed += wait_rank(pids[i], "duplicate rank", i == 0 ? 0 : 1);
    if (failed != 0)
        TEST_FAIL("a bad join was not refused on every rank");
}

static int body_mismatched_sizes(int rank, int world_size, void *arg)
{
    (void)arg;
    epx__bootstrap_t *bootstrap = NULL;
    CHECK_OK(epx__bootstrap_create_tcp(&g_id, rank, world_size, LONG_TIMEOUT_MS, &bootstrap));
    char send[16] = {0}, recv[32];
    size_t bytes = rank == 0 ? 8 : 16;
    CHECK_STATUS(epx__bootstrap_allgather(bootstrap, send, recv, bytes), EPX_ERR_BOOTSTRAP);
    CHECK_ERROR_MENTIONS("not running the same collective");
    epx__bootstrap_destroy(bootstrap);
    return 0;
}

static void test_mismatched_allgather_sizes(void)
{
    g_id = fresh_id();
    if (run_ranks("mismatched sizes", 2, 2, body_mismatched_sizes, NULL) != 0)
        TEST_FAIL("an allgather with different sizes was not refused");
}

/* ---------------------------------------------------------------- unique ids */

static void check_rejected(const char *text, const char *needle)
{
    epx_unique_id_t id;
    memset(&id, 'Z', sizeof(id));
    CHECK_STATUS(epx_unique_id_from_string(text, &id), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS(needle);
    for (size_t i = 0; i < sizeof(id.internal); i++)
        if (id.internal[i] != 'Z')
            TEST_FAIL("a rejected id text (%s) wrote the output", text);
}

static void test_unique_id_text(void)
{
    epx_unique_id_t a = fresh_id(), b = fresh_id(), back;
    char text[EPX_UNIQUE_ID_BYTES];
    CHECK_OK(epx_unique_id_to_string(&a, text, sizeof(text)));
    CHECK(strncmp(text, "epx1:127.0.0.1:", 15) == 0);
    CHECK_OK(epx_unique_id_from_string(text, &back));
    CHECK(strcmp(back.internal, a.internal) == 0);
    CHECK(strcmp(a.internal, b.internal) != 0); /* another nonce, likely another port */
    const char *nonce_a = strrchr(a.internal, ':'), *nonce_b = strrchr(b.internal, ':');
    CHECK(strlen(nonce_a + 1) == 16 && strcmp(nonce_a, nonce_b) != 0);

    char small[8];
    CHECK_STATUS(epx_unique_id_to_string(&a, small, sizeof(small)), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("text_size");
    CHECK_STATUS(epx_unique_id_to_string(NULL, text, sizeof(text)), EPX_ERR_INVALID_ARG);
    CHECK_STATUS(epx_unique_id_from_string(NULL, &back), EPX_ERR_INVALID_ARG);

    check_rejected("", "epx1:");
    check_rejected("epx2:1.2.3.4:80:0123456789abcdef", "epx1:");
    check_rejected("epx1:1.2.3.4:80", "lacks a field");
    check_rejected("epx1:1.2.3:80:0123456789abcdef", "address");
    check_rejected("epx1:host:80:0123456789abcdef", "address");
    check_rejected("epx1:1.2.3.4:0:0123456789abcdef", "port");
    check_rejected("epx1:1.2.3.4:70000:0123456789abcdef", "port");
    check_rejected("epx1:1.2.3.4:8a:0123456789abcdef", "port");
    check_rejected("epx1:1.2.3.4:80:0123", "nonce");
    check_rejected("epx1:1.2.3.4:80:0123456789abcdeg", "nonce");
    check_rejected("epx1:1.2.3.4:80:0123456789abcdef0", "nonce");
    char long_text[300];
    memset(long_text, '1', sizeof(long_text) - 1);
    long_text[sizeof(long_text) - 1] = '\0';
    check_rejected(long_text, "longer");
    CHECK_OK(epx_unique_id_from_string("epx1:10.1.2.3:65535:FFFFffff00000000", &back));

    /* An address nobody can connect to, or not an address at all, is refused. */
    setenv("EPX_BOOTSTRAP_ADDR", "not-an-ip", 1);
    epx__params_reset();
    CHECK_STATUS(epx_get_unique_id(&back), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("EPX_BOOTSTRAP_ADDR");
    setenv("EPX_BOOTSTRAP_ADDR", "0.0.0.0", 1);
    epx__params_reset();
    CHECK_STATUS(epx_get_unique_id(&back), EPX_ERR_INVALID_ARG);
    CHECK_ERROR_MENTIONS("0.0.0.0");
    unsetenv("EPX_BOOTSTRAP_ADDR");
    epx__params_reset();
    CHECK_OK(epx_get_unique_id(&back));
}

/*
 * A frame's header and body leave in one sendmsg where the socket takes them: a body
 * larger than the socket's buffer goes out in parts (the send waits for room), empty
 * parts are skipped, and a reader that went away is EPX__IO_CLOSED, not a SIGPIPE.
 */
static void test_send_two(void)
{
    int fds[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    static const char head[12] = "frame head!";
    const size_t body_length = (size_t)4 << 20, total = sizeof(head) + body_length + 3;
    unsigned char *body = malloc(body_length);
    CHECK(body != NULL);
    for (size_t i = 0; i < body_length; i++)
        body[i] = (unsigned char)(i * 7 + 1);
    pid_t reader = fork();
    CHECK(reader >= 0);
    if (reader == 0) {
        close(fds[0]);
        unsigned char *got = malloc(total);
        int error_code = 0;
        int ok = got != NULL && epx__recv_all(fds[1], got, total, epx__deadline_after_ms(10000),
                                              &error_code) == EPX__IO_OK;
        ok = ok && memcmp(got, head, sizeof(head)) == 0 &&
             memcmp(got + sizeof(head), body, body_length) == 0 &&
             memcmp(got + sizeof(head) + body_length, "abc", 3) == 0;
        _exit(ok ? 0 : 1);
    }
    close(fds[1]);
    int error_code = 0;
    const int64_t deadline = epx__deadline_after_ms(10000);
    CHECK(epx__send_two(fds[0], head, sizeof(head), body, body_length, deadline, &error_code) ==
          EPX__IO_OK);
    CHECK(epx__send_two(fds[0], NULL, 0, NULL, 0, deadline, &error_code) == EPX__IO_OK);
    CHECK(epx__send_two(fds[0], "ab", 2, "c", 1, deadline, &error_code) == EPX__IO_OK);
    int status = 0;
    CHECK(waitpid(reader, &status, 0) == reader);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(epx__send_two(fds[0], head, sizeof(head), body, 1, deadline, &error_code) ==
          EPX__IO_CLOSED);
    close(fds[0]);
    free(body);
}

int main(void)
{
    alarm(100); /* the children have their own guards; this one covers the parent */
    struct {
        const char *name;
        void (*run)(void);
    } tests[] = {
        {"send_two", test_send_two},
        {"unique_id_text", test_unique_id_text},
        {"groups_of_several_sizes", test_groups_of_several_sizes},
        {"rank_that_never_joins", test_rank_that_never_joins},
        {"root_that_never_comes", test_root_that_never_comes},
        {"rank_late_to_allgather", test_rank_late_to_allgather},
        {"barrier_holds", test_barrier_holds},
        {"rank_that_exits", test_rank_that_exits},
        {"wrong_nonce_is_refused", test_wrong_nonce_is_refused},
        {"bad_joins_are_refused", test_bad_joins_are_refused},
        {"mismatched_allgather_sizes", test_mismatched_allgather_sizes},
    };
    for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
        int64_t start = epx__now_ns();
        tests[i].run();
        printf("ok   %-28s %6.0f ms\n", tests[i].name, elapsed_ms(start));
        fflush(stdout);
    }
    return 0;
}
