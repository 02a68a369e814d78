/*
 * A rank killed inside epx_buffer_create leaves no shared memory behind, whatever the
 * moment, and the other ranks get an error instead of a hang.
 *
 *   test_create_killed [--backend host|auto] [--variant exact|random|all]
 *
 * The program is its own launcher (as test_killed_rank): it starts 4 ranks and checks
 * how they end and what /dev/shm holds afterwards. To die at an exact step, each rank
 * makes its group with bootstrap callbacks that forward to a plain TCP group, so the
 * ranks can count the exchanges of buffer creation:
 *   exact:  for every exchange n of a buffer create (with low-latency memory: the config
 *           vote, then the set-up exchanges of each shared-memory area), rank 2 SIGKILLs
 *           itself on entering exchange n, and again right after leaving it;
 *   random: rank 2 creates and destroys buffers in a loop and a timer SIGKILLs it at a
 *           random moment after the loop started (10 rounds).
 * The survivors' create, or the destroy after it (it votes), or the next create must fail
 * within the timeout.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "test_util.h"

#define NUM_RANKS 4
#define VICTIM 2
#define TIMEOUT_MS 5000
/* Exchanges of one buffer create with low-latency memory on the CPU backend (counted
 * by the child's first create, which no one kills; checked there). */
#define MAX_EXCHANGES 16

/* ---------------------------------------------------------------- child */

typedef struct {
    epx_group_t outer;  /* the TCP group that carries the exchanges */
    int rank;
    int calls;          /* exchanges since the counter was reset */
    int kill_at;        /* SIGKILL on entering this exchange (0 = never) */
    int kill_after;     /* SIGKILL on leaving this exchange (0 = never) */
} relay_t;

static int relay_allgather(void *ctx, const void *send, void *recv, size_t bytes)
{
    relay_t *relay = ctx;
    relay->calls++;
    if (relay->calls == relay->kill_at)
        raise(SIGKILL);
    epx_status_t status = epx_group_allgather(relay->outer, send, recv, bytes);
    if (relay->calls == relay->kill_after)
        raise(SIGKILL);
    return status == EPX_SUCCESS ? 0 : 1;
}

static int relay_barrier(void *ctx)
{
    relay_t *relay = ctx;
    return epx_group_barrier(relay->outer) == EPX_SUCCESS ? 0 : 1;
}

static epx_buffer_config_t buffer_config(void)
{
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = 8;
    config.hidden = 256;
    config.num_experts = 2 * NUM_RANKS;
    config.num_topk = 2;
    config.max_low_latency_tokens = 4;
    return config;
}

/* SIGKILL this process `ms` milliseconds from now (a POSIX timer: nobody else involved). */
static void kill_me_in(int ms)
{
    struct sigevent event;
    memset(&event, 0, sizeof event);
    event.sigev_notify = SIGEV_SIGNAL;
    event.sigev_signo = SIGKILL;
    timer_t timer;
    CHECK(timer_create(CLOCK_MONOTONIC, &event, &timer) == 0);
    struct itimerspec when;
    memset(&when, 0, sizeof when);
    when.it_value.tv_sec = ms / 1000;
    when.it_value.tv_nsec = (long)(ms % 1000) * 1000000L;
    CHECK(timer_settime(timer, 0, &when, NULL) == 0);
}

/*
 * Rank `rank` of one run: kill_at/kill_after select the victim's moment (exact), or 0;
 * kill_ms > 0: the victim loops over creates and dies that long after the loop started.
 */
static int run_child(int argc, char **argv, int kill_at, int kill_after, int kill_ms)
{
    int loop = kill_ms > 0;
    alarm(60);
    relay_t relay;
    memset(&relay, 0, sizeof relay);
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    relay.outer = mr_group_create(argc, argv, &info);
    relay.rank = info.rank;
    epx_bootstrap_callbacks_t callbacks = {relay_allgather, relay_barrier, &relay};
    epx_group_config_t gc = EPX_GROUP_CONFIG_INIT;
    gc.rank = info.rank;
    gc.world_size = info.world_size;
    gc.backend = info.backend;
    gc.callbacks = &callbacks;
    gc.timeout_ms = TIMEOUT_MS;
    epx_group_t group;
    CHECK_OK(epx_group_create(&gc, &group));
    epx_buffer_config_t config = buffer_config();
    epx_buffer_t buffer;

    /* One create that nobody disturbs: it counts the exchanges. */
    relay.calls = 0;
    CHECK_OK(epx_buffer_create(group, &config, &buffer));
    int exchanges = relay.calls;
    CHECK(exchanges >= 3 && exchanges <= MAX_EXCHANGES);
    CHECK_OK(epx_buffer_destroy(buffer));
    if (kill_at > exchanges || kill_after > exchanges) {
        /* Past the last exchange: the parent asked for more than there are. */
        printf("[rank %d] a create takes %d exchanges\n", info.rank, exchanges);
        fflush(stdout);
        CHECK_OK(epx_group_destroy(group));
        _exit(3);
    }

    if (info.rank == VICTIM) {
        relay.calls = 0;
        relay.kill_at = kill_at;
        relay.kill_after = kill_after;
        if (loop)
            kill_me_in(kill_ms);
    }
    double start = mr_now_ms();
    epx_status_t status = EPX_SUCCESS;
    for (int round = 0; status == EPX_SUCCESS && (loop || round < 2); round++) {
        relay.calls = 0;
        status = epx_buffer_create(group, &config, &buffer);
        /* The destroy votes too: a rank killed after the create's last exchange shows
         * there (and the buffer is freed all the same). */
        if (status == EPX_SUCCESS)
            status = epx_buffer_destroy(buffer);
        if (mr_now_ms() - start > 30000)
            TEST_FAIL("rank %d: creates still succeed 30 s after rank %d should have died",
                      info.rank, VICTIM);
    }
    double elapsed = mr_now_ms() - start;
    if (info.rank == VICTIM)
        TEST_FAIL("rank %d was to die but its create returned %s", info.rank,
                  epx_status_name(status));
    if (status != EPX_ERR_REMOTE && status != EPX_ERR_BOOTSTRAP && status != EPX_ERR_TIMEOUT)
        TEST_FAIL("rank %d: create returned %s (%s), expected a peer failure", info.rank,
                  epx_status_name(status), epx_last_error());
    if (elapsed > 2.0 * TIMEOUT_MS + 5000)
        TEST_FAIL("rank %d: the failure took %.0f ms", info.rank, elapsed);
    /* The groups may be broken (their exchanges failed); destroying them is local. */
    epx_group_destroy(group);
    epx_group_destroy(relay.outer);
    return 0;
}

/* ---------------------------------------------------------------- parent */

/* Names in /dev/shm starting with "epx-", '\n' after each. */
static void list_segments(char *names, size_t size)
{
    size_t used = 0;
    names[0] = '\0';
    DIR *dir = opendir("/dev/shm");
    if (dir == NULL)
        return;
    for (struct dirent *entry = readdir(dir); entry != NULL; entry = readdir(dir))
        if (strncmp(entry->d_name, "epx-", 4) == 0 && used + strlen(entry->d_name) + 2 < size)
            used += (size_t)snprintf(names + used, size - used, "%s\n", entry->d_name);
    closedir(dir);
}

/* Does `names` hold a segment of one of `pids`? (Names carry their maker's pid.) */
static int segments_of(const char *names, const pid_t *pids, int count, char *out, size_t size)
{
    int found = 0;
    out[0] = '\0';
    for (int r = 0; r < count; r++) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "epx-%ld-", (long)pids[r]);
        for (const char *at = strstr(names, prefix); at != NULL; at = strstr(at + 1, prefix)) {
            if (at != names && at[-1] != '\n')
                continue;
            found++;
            size_t length = strcspn(at, "\n");
            size_t used = strlen(out);
            if (used + length + 2 < size)
                snprintf(out + used, size - used, "%.*s\n", (int)length, at);
        }
    }
    return found;
}

typedef struct {
    const char *name;
    int kill_at, kill_after;
    int random_ms; /* > 0: the victim loops over creates and dies after this many ms */
} moment_t;

/* One run of 4 ranks. Returns 0 if all went right, 1 on a failure, 3 if the moment is
 * past the last exchange (nothing was run). */
static int run_moment(const moment_t *m, const char *backend)
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
            char text[3][32];
            snprintf(text[0], sizeof text[0], "%d", m->kill_at);
            snprintf(text[1], sizeof text[1], "%d", m->kill_after);
            snprintf(text[2], sizeof text[2], "%d", m->random_ms);
            mr_set_rank_env(r, NUM_RANKS, id_text);
            setenv("EPX_LOG_LEVEL", "error", 1);
            char *child_argv[] = {"test_create_killed", "--child", "1", "--kill-at", text[0],
                                  "--kill-after", text[1], "--kill-ms", text[2], "--backend",
                                  (char *)backend, NULL};
            execv("/proc/self/exe", child_argv);
            _exit(127);
        }
    }
    int failures = 0, past_end = 0;
    for (int r = 0; r < NUM_RANKS; r++) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        int killed = r == VICTIM && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 3) {
            past_end = 1;
        } else if (r == VICTIM ? !killed : !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            failures++;
            fprintf(stderr, "FAIL %s: rank %d ended with %s %d\n", m->name, r,
                    WIFSIGNALED(status) ? "signal" : "status",
                    WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
        }
    }
    if (past_end)
        return failures > 0 ? 1 : 3;
    static char names[1 << 16], leaked[1 << 16];
    list_segments(names, sizeof names);
    if (segments_of(names, pids, NUM_RANKS, leaked, sizeof leaked) > 0) {
        fprintf(stderr, "FAIL %s: left in /dev/shm:\n%s", m->name, leaked);
        failures++;
    }
    printf("%s %s\n", failures == 0 ? "ok  " : "FAIL", m->name);
    fflush(stdout);
    return failures > 0 ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (mr_flag(argc, argv, "--child", NULL) != NULL)
        return run_child(argc, argv, atoi(mr_flag(argc, argv, "--kill-at", "0")),
                         atoi(mr_flag(argc, argv, "--kill-after", "0")),
                         atoi(mr_flag(argc, argv, "--kill-ms", "0")));
    const char *backend = mr_flag(argc, argv, "--backend", "host");
    const char *variant = mr_flag(argc, argv, "--variant", "all");
    int failures = 0;
    if (strcmp(variant, "exact") == 0 || strcmp(variant, "all") == 0) {
        for (int n = 1; n <= MAX_EXCHANGES; n++) {
            char name_at[64], name_after[64];
            snprintf(name_at, sizeof name_at, "killed entering exchange %d", n);
            snprintf(name_after, sizeof name_after, "killed leaving exchange %d", n);
            moment_t at = {name_at, n, 0, 0}, after = {name_after, 0, n, 0};
            int result = run_moment(&at, backend);
            if (result == 3)
                break;
            failures += result;
            failures += run_moment(&after, backend) == 1;
        }
    }
    if (strcmp(variant, "random") == 0 || strcmp(variant, "all") == 0) {
        srand((unsigned)time(NULL) ^ (unsigned)getpid());
        for (int round = 0; round < 10; round++) {
            char name[64];
            int ms = 50 + rand() % 400;
            snprintf(name, sizeof name, "killed at a random moment (%d ms)", ms);
            moment_t m = {name, 0, 0, ms};
            failures += run_moment(&m, backend);
        }
    }
    if (failures > 0) {
        fprintf(stderr, "test_create_killed: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_create_killed: ok\n");
    return 0;
}
