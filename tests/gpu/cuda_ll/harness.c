/* tests/gpu/cuda_ll: failures, flags, the watchdog, the host collective between sub-tests. */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda_ll.h"

int g_rank = -1, g_world = 0;
epx_group_t g_group;
cudaStream_t g_stream;
int g_failures = 0;     /* this rank's failed checks, all sub-tests so far */
int g_subtest_base = 0; /* g_failures when the running sub-test started */
int g_sms = 16;

void fail(const char *what, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fprintf(stderr, "cuda_ll: rank %d: %s: ", g_rank, what);
    vfprintf(stderr, format, args);
    fprintf(stderr, "\n");
    va_end(args);
    g_failures++;
}

/* ---------------------------------------------------------------- flags, watchdog */

long long flag_value(int argc, char **argv, const char *name, long long fallback)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return atoll(argv[i + 1]);
    return fallback;
}

const char *flag_text(int argc, char **argv, const char *name, const char *fallback)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return argv[i + 1];
    return fallback;
}

static char g_watchdog_message[256];
static size_t g_watchdog_length;

void on_watchdog(int signal_number)
{
    (void)signal_number;
    if (write(STDERR_FILENO, g_watchdog_message, g_watchdog_length) < 0) {
        /* nothing more to do: exiting anyway */
    }
    _exit(3);
}

/* Unless alarm(0) comes within `seconds`, end the process with a message naming `subtest`. */
void watchdog_arm(const char *subtest, unsigned seconds)
{
    int n = snprintf(g_watchdog_message, sizeof(g_watchdog_message),
                     "cuda_ll: rank %d: FAIL %s: not finished after %u s (a hang: see the "
                     "other ranks' logs)\n", g_rank, subtest, seconds);
    g_watchdog_length = n < 0 ? 0 : n >= (int)sizeof(g_watchdog_message)
                                        ? sizeof(g_watchdog_message) - 1 : (size_t)n;
    alarm(seconds);
}

double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Every rank's `mine` summed (a host collective, so also a barrier); the ranks whose
 * value is nonzero into failed_ranks (may be NULL). */
int sum_over_ranks(int mine, int *failed_ranks, int *failed_count)
{
    int *all = calloc((size_t)g_world, sizeof(int));
    if (all == NULL)
        exit(1);
    epx_status_t status = epx_group_allgather(g_group, &mine, all, sizeof(int));
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "cuda_ll: rank %d: allgather between sub-tests: %s: %s\n", g_rank,
                epx_status_name(status), epx_last_error());
        exit(1);
    }
    int total = 0, n = 0;
    for (int r = 0; r < g_world; r++) {
        total += all[r];
        if (all[r] != 0 && failed_ranks != NULL)
            failed_ranks[n++] = r;
    }
    if (failed_count != NULL)
        *failed_count = n;
    free(all);
    return total;
}

/*
 * Did any rank fail in this sub-test so far? Every rank calls it at the same points
 * (before each step), which also keeps the ranks in step: nobody starts a step, and so
 * waits on a peer, while that peer is still computing its oracle.
 */
int any_failure(void)
{
    return sum_over_ranks(g_failures - g_subtest_base, NULL, NULL) > 0;
}
