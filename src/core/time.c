/*
 * The library's clock. Timeouts and benchmarks measure intervals, so the clock must
 * not jump when the wall clock is adjusted: CLOCK_MONOTONIC.
 */
#include <time.h>

#include "core/core.h"

int64_t epx__now_ns(void)
{
    struct timespec now;
    /* Cannot fail for CLOCK_MONOTONIC with a valid pointer on Linux. */
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}
