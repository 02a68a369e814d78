/*
 * What every `epx` subcommand shares beyond the public API (include/epx.h,
 * include/epx_tool.h): a clock, the tool's own failures, and reading a tunable.
 */
#ifndef EPX_TOOLS_COMMON_TOOL_H
#define EPX_TOOLS_COMMON_TOOL_H

#include <stdint.h>
#include <sys/types.h>

#include "epx.h"
#include "epx_tool.h"

/* Monotonic clock in nanoseconds. */
int64_t epx__tool_now_ns(void);

/*
 * A failure found by the tool itself (not by a library call): records the message that
 * epx__tool_error_text then returns, and returns `status`.
 */
epx_status_t epx__tool_error(epx_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The text of the latest failure: the tool's own when it recorded one after the last
 * library failure was read, else epx_last_error(). Reading forgets the tool's. */
const char *epx__tool_error_text(void);

/*
 * Wait until child `pid` exits or the monotonic clock passes deadline_ns; then kill it
 * (and its process group, when it leads one) and reap it. Returns the wait status, or -1
 * when it had to be killed or could not be waited for.
 */
int epx__tool_wait_child(pid_t pid, int64_t deadline_ns);

/* The value in force of an integer / text tunable ("EPX_NUM_SMS"); 0 / "" if unknown. */
int64_t epx__tool_param_int(const char *name);
const char *epx__tool_param_string(const char *name);

#endif /* EPX_TOOLS_COMMON_TOOL_H */
