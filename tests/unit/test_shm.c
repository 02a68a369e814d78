/*
 * The shared-memory transport of the host backend (src/transport/shm/shm.h), with real
 * ranks: the test forks 4 processes that form a group over the TCP bootstrap and map
 * each other's segments. Scenarios: data crosses barriers intact; a rank that exits
 * (reaped or left a zombie), a rank that aborts, and a rank that never arrives each
 * end the others' waits with the right status, naming the rank, quickly; setup that
 * runs out of /dev/shm fails on every rank. After every scenario no /dev/shm/epx-*
 * segment of the children remains.
 */
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "test_util.h"
#include "transport/shm/shm_private.h"

#define WORLD 4
#define SCENARIO_DEADLINE_S 30

typedef struct {
    const char *name;
    int64_t timeout_ms;    /* group timeout */
    size_t bytes_per_rank; /* 0 = 64 KiB */
    int reap_last;         /* rank the parent reaps only after all others (-1 = none) */
    /* Runs in each child after the group and the segments exist; returns the exit code. */
    int (*body)(int rank, epx__shm_t *shm);
    /* Instead of body: runs with the create status (setup failure scenarios). */
    int (*on_create)(int rank, epx_status_t status);
} scenario_t;

static double seconds_since(int64_t start_ns)
{
    return (double)(epx__now_ns() - start_ns) / 1e9;
}

static void sleep_ms(long ms)
{
    struct timespec pause = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&pause, NULL);
}

/* ---------------------------------------------------------------- scenarios */

/* Values cross barriers: into one's own segment and into peers' segments. */
static int body_barriers(int rank, epx__shm_t *shm)
{
    CHECK(epx__shm_peer(shm, -1) == NULL);
    CHECK(epx__shm_peer(shm, WORLD) == NULL);
    for (int r = 0; r < WORLD; r++) {
        CHECK(((uintptr_t)epx__shm_peer(shm, r) & 4095u) == 0);
        CHECK_EQ_INT(((const uint64_t *)epx__shm_peer(shm, r))[100], 0); /* starts zeroed */
    }
    CHECK_EQ_INT(epx__shm_data_bytes(shm), 64 * 1024);
    for (uint64_t round = 1; round <= 500; round++) {
        uint64_t *own = epx__shm_peer(shm, rank);
        own[0] = round * 16 + (uint64_t)rank;
        for (int r = 0; r < WORLD; r++)
            ((uint64_t *)epx__shm_peer(shm, r))[1 + rank] = round * 1000 + (uint64_t)rank;
        CHECK_OK(epx__shm_barrier(shm, "test (values written)"));
        CHECK_OK(epx__shm_check_failed(shm, "test (nobody failed)"));
        for (int s = 0; s < WORLD; s++) {
            CHECK_EQ_INT(((const uint64_t *)epx__shm_peer(shm, s))[0], round * 16 + (uint64_t)s);
            CHECK_EQ_INT(own[1 + s], round * 1000 + (uint64_t)s);
        }
        /* Nobody writes the next round before everyone has read this one. */
        CHECK_OK(epx__shm_barrier(shm, "test (values read)"));
    }
    return 0;
}

/* Rank 2 leaves without a word; the others must notice its death, not time out. */
static int body_exit(int rank, epx__shm_t *shm)
{
    CHECK_OK(epx__shm_barrier(shm, "test (all present)"));
    if (rank == 2)
        _exit(0);
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx__shm_barrier(shm, "test (waiting for rank 2)"), EPX_ERR_REMOTE);
    double waited = seconds_since(start);
    CHECK_ERROR_MENTIONS("test (waiting for rank 2): rank 2 (pid ");
    CHECK_ERROR_MENTIONS(") exited");
    if (waited > 1.0)
        TEST_FAIL("rank %d took %.3f s to notice that rank 2 exited", rank, waited);
    /* The next wait fails the same way (the rank stays dead). */
    CHECK_STATUS(epx__shm_barrier(shm, "test (again)"), EPX_ERR_REMOTE);
    CHECK_ERROR_MENTIONS("rank 2");
    return 0;
}

/* Rank 1 publishes a failure; the others get it with its message. */
static int body_abort(int rank, epx__shm_t *shm)
{
    CHECK_OK(epx__shm_barrier(shm, "test (all present)"));
    if (rank == 1) {
        epx__shm_abort(shm, EPX_ERR_INVALID_ARG, "rank one gave up on purpose");
        epx__shm_abort(shm, EPX_ERR_CAPACITY, "a second failure is not published");
        const epx__shm_header_t *header = (const epx__shm_header_t *)shm->headers[1];
        CHECK_EQ_INT(header->abort_rank, 1);
        CHECK_EQ_INT(header->abort_status, EPX_ERR_INVALID_ARG);
        CHECK(strcmp(header->abort_message, "rank one gave up on purpose") == 0);
        sleep_ms(1500); /* alive: the others must learn from the abort word, not the exit */
        return 0;
    }
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx__shm_barrier(shm, "dispatch (waiting for data)"), EPX_ERR_REMOTE);
    CHECK_ERROR_MENTIONS("dispatch (waiting for data): rank 1 failed: rank one gave up on purpose");
    /* Asked without a wait, the same answer. */
    CHECK_STATUS(epx__shm_check_failed(shm, "combine (before mapping)"), EPX_ERR_REMOTE);
    CHECK_ERROR_MENTIONS("combine (before mapping): rank 1 failed: rank one gave up on purpose");
    if (seconds_since(start) > 1.0)
        TEST_FAIL("rank %d took %.3f s to see rank 1's abort", rank, seconds_since(start));
    if (rank == 0) {
        /* Passing the failure on keeps the name of the rank that failed first. */
        epx__shm_abort(shm, EPX_ERR_REMOTE, epx_last_error());
        const epx__shm_header_t *header = (const epx__shm_header_t *)shm->headers[0];
        CHECK_EQ_INT(header->abort_rank, 1);
        CHECK_EQ_INT(header->abort_status, EPX_ERR_REMOTE);
        CHECK(strcmp(header->abort_message, "rank one gave up on purpose") == 0);
    }
    return 0;
}

/* Rank 3 is alive but never arrives; the others time out after 1 s, naming it. */
static int body_timeout(int rank, epx__shm_t *shm)
{
    CHECK_OK(epx__shm_barrier(shm, "test (all present)"));
    if (rank == 3) {
        sleep_ms(2500);
        return 0;
    }
    int64_t start = epx__now_ns();
    CHECK_STATUS(epx__shm_barrier(shm, "combine (waiting for data)"), EPX_ERR_TIMEOUT);
    double waited = seconds_since(start);
    CHECK_ERROR_MENTIONS("combine (waiting for data): rank 3 did not arrive within 1000 ms");
    if (waited < 0.99 || waited > 1.5)
        TEST_FAIL("rank %d timed out after %.3f s, expected about 1 s", rank, waited);
    return 0;
}

/* Ranks 2 and 3 never arrive; the others name both. */
static int body_timeout_two(int rank, epx__shm_t *shm)
{
    CHECK_OK(epx__shm_barrier(shm, "test (all present)"));
    if (rank >= 2) {
        sleep_ms(1800);
        return 0;
    }
    CHECK_STATUS(epx__shm_barrier(shm, "dispatch (waiting for counts)"), EPX_ERR_TIMEOUT);
    CHECK_ERROR_MENTIONS("dispatch (waiting for counts): ranks 2, 3 did not arrive within 1000 ms");
    return 0;
}

/* Every rank asks for more than /dev/shm holds: all fail cleanly with the reason. */
static int on_create_all_too_big(int rank, epx_status_t status)
{
    (void)rank;
    CHECK_EQ_INT(status, EPX_ERR_OUT_OF_MEMORY);
    CHECK_ERROR_MENTIONS("/dev/shm");
    return 0;
}

/* Only rank 2 asks for too much: it fails with the reason, the others name it. */
static int on_create_one_too_big(int rank, epx_status_t status)
{
    if (rank == 2) {
        CHECK_EQ_INT(status, EPX_ERR_OUT_OF_MEMORY);
        CHECK_ERROR_MENTIONS("/dev/shm");
    } else {
        CHECK_EQ_INT(status, EPX_ERR_REMOTE);
        CHECK_ERROR_MENTIONS("shm setup: rank 2 failed: ");
        CHECK_ERROR_MENTIONS("/dev/shm");
    }
    return 0;
}

/* ---------------------------------------------------------------- harness */

#define TOO_BIG ((size_t)1 << 42) /* 4 TiB: more than any /dev/shm here */

static size_t bytes_for(const scenario_t *s, int rank)
{
    if (s->on_create == on_create_one_too_big)
        return rank == 2 ? TOO_BIG : 64 * 1024;
    return s->bytes_per_rank ? s->bytes_per_rank : 64 * 1024;
}

static int run_child(const scenario_t *s, int rank, const epx_unique_id_t *id)
{
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = WORLD;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = id;
    config.timeout_ms = s->timeout_ms;
    epx_group_t group = NULL;
    CHECK_OK(epx_group_create(&config, &group));
    epx__shm_t *shm = NULL;
    epx__transport_ranks_t ranks = epx__group_ranks(group);
    epx_status_t status = epx__shm_create(&ranks, bytes_for(s, rank), &shm);
    int code;
    if (s->on_create != NULL) {
        code = s->on_create(rank, status);
        CHECK(shm == NULL);
    } else {
        if (status != EPX_SUCCESS)
            TEST_FAIL("rank %d: epx__shm_create: %s", rank, epx_last_error());
        code = s->body(rank, shm);
    }
    epx__shm_destroy(shm);
    epx_group_destroy(group);
    return code;
}

/* Segments named /epx-<pid>-... by any of these processes. */
static int count_segments(const pid_t *pids)
{
    DIR *dir = opendir("/dev/shm");
    if (dir == NULL)
        return 0;
    int found = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        for (int r = 0; r < WORLD; r++) {
            char prefix[64];
            snprintf(prefix, sizeof(prefix), "epx-%ld-", (long)pids[r]);
            if (strncmp(entry->d_name, prefix, strlen(prefix)) == 0) {
                fprintf(stderr, "left behind: /dev/shm/%s\n", entry->d_name);
                found++;
            }
        }
    }
    closedir(dir);
    return found;
}

static void run_scenario(const scenario_t *s)
{
    epx_unique_id_t id;
    CHECK_OK(epx_get_unique_id(&id));
    pid_t pids[WORLD];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < WORLD; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0)
            _exit(run_child(s, r, &id));
    }
    int done[WORLD] = {0}, codes[WORLD] = {0}, remaining = WORLD;
    int64_t start = epx__now_ns();
    while (remaining > 0) {
        for (int r = 0; r < WORLD; r++) {
            /* Leave the chosen rank a zombie while the others run, so that the liveness
             * check has to see through the zombie state. */
            if (done[r] || (r == s->reap_last && remaining > 1))
                continue;
            int wstatus;
            if (waitpid(pids[r], &wstatus, WNOHANG) == pids[r]) {
                done[r] = 1;
                remaining--;
                codes[r] = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
            }
        }
        if (seconds_since(start) > SCENARIO_DEADLINE_S) {
            for (int r = 0; r < WORLD; r++)
                if (!done[r])
                    kill(pids[r], SIGKILL);
            TEST_FAIL("%s: ranks still running after %d s (hang)", s->name, SCENARIO_DEADLINE_S);
        }
        sleep_ms(5);
    }
    for (int r = 0; r < WORLD; r++)
        if (codes[r] != 0)
            TEST_FAIL("%s: rank %d exited with %d", s->name, r, codes[r]);
    CHECK_EQ_INT(count_segments(pids), 0);
    printf("ok   %-28s %.2f s\n", s->name, seconds_since(start));
}

int main(void)
{
    const scenario_t scenarios[] = {
        {"barriers", 20000, 0, -1, body_barriers, NULL},
        {"exit (zombie)", 20000, 0, 2, body_exit, NULL},
        {"exit (reaped)", 20000, 0, -1, body_exit, NULL},
        {"abort", 20000, 0, -1, body_abort, NULL},
        {"timeout", 1000, 0, -1, body_timeout, NULL},
        {"timeout (two missing)", 1000, 0, -1, body_timeout_two, NULL},
        {"setup: all out of /dev/shm", 20000, TOO_BIG, -1, NULL, on_create_all_too_big},
        {"setup: one out of /dev/shm", 20000, 0, -1, NULL, on_create_one_too_big},
    };
    for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++)
        run_scenario(&scenarios[i]);
    printf("test_shm: all passed\n");
    return 0;
}
