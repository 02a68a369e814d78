/*
 * The monotonic clock: never goes back, and measures a sleep to within reason.
 */
#include <time.h>

#include "core/core.h"
#include "test_util.h"

int main(void)
{
    int64_t previous = epx__now_ns();
    CHECK(previous > 0);
    for (int i = 0; i < 100000; i++) {
        int64_t now = epx__now_ns();
        CHECK(now >= previous);
        previous = now;
    }

    int64_t start = epx__now_ns();
    struct timespec twenty_ms = {0, 20 * 1000 * 1000};
    CHECK(nanosleep(&twenty_ms, NULL) == 0);
    int64_t elapsed = epx__now_ns() - start;
    CHECK(elapsed >= 20 * 1000 * 1000);
    /* Generous: a loaded CI machine may oversleep, but not by seconds. */
    CHECK(elapsed < 5LL * 1000 * 1000 * 1000);

    printf("test_time: ok\n");
    return 0;
}
