/*
 * Run ranks as forked child processes, for tests of collectives on one machine.
 * Each child has an alarm() guard, so a hang becomes a killed child (reported as a
 * failure with the signal) instead of a stuck test.
 */
#ifndef EPX_TEST_FORK_RANKS_H
#define EPX_TEST_FORK_RANKS_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* A rank's body: returns 0 when every check passed (CHECK macros exit(1) on failure). */
typedef int (*rank_body_t)(int rank, int world_size, void *arg);

#define RANK_GUARD_SECONDS 20

static pid_t fork_rank(rank_body_t body, int rank, int world_size, void *arg)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(1);
    }
    if (pid == 0) {
        alarm(RANK_GUARD_SECONDS);
        exit(body(rank, world_size, arg));
    }
    return pid;
}

/* Wait for one child; 0 if it exited with status 0, else 1 (with a line saying why). */
static int wait_rank(pid_t pid, const char *what, int rank)
{
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        perror("waitpid");
        return 1;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return 0;
    if (WIFSIGNALED(status))
        fprintf(stderr, "%s: rank %d killed by signal %d%s\n", what, rank, WTERMSIG(status),
                WTERMSIG(status) == SIGALRM ? " (hung past its guard)" : "");
    else
        fprintf(stderr, "%s: rank %d exited with status %d\n", what, rank,
                WEXITSTATUS(status));
    return 1;
}

/* Start ranks 0..count-1 of a world of `world_size` (count < world_size leaves the last
 * ranks missing) and wait for all; returns the number of ranks that failed. */
static int run_ranks(const char *what, int count, int world_size, rank_body_t body, void *arg)
{
    pid_t pids[64];
    for (int r = 0; r < count; r++)
        pids[r] = fork_rank(body, r, world_size, arg);
    int failed = 0;
    for (int r = 0; r < count; r++)
        failed += wait_rank(pids[r], what, r);
    return failed;
}

#endif /* EPX_TEST_FORK_RANKS_H */
