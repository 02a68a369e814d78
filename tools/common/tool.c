/* The `epx` command's shared helpers (tool.h). */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/wait.h>
#include <time.h>

#include "common/tool.h"

int64_t epx__tool_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

static _Thread_local char tool_error[512];

epx_status_t epx__tool_error(epx_status_t status, const char *fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    vsnprintf(tool_error, sizeof(tool_error), fmt, args);
    va_end(args);
    return status;
}

const char *epx__tool_error_text(void)
{
    static _Thread_local char taken[sizeof(tool_error)];
    if (tool_error[0] == '\0')
        return epx_last_error();
    snprintf(taken, sizeof(taken), "%s", tool_error);
    tool_error[0] = '\0';
    return taken;
}

int64_t epx__tool_param_int(const char *name)
{
    epx_param_info_t info = EPX_PARAM_INFO_INIT;
    return epx_param_find(name, &info) == EPX_SUCCESS && info.is_int ? info.int_value : 0;
}

const char *epx__tool_param_string(const char *name)
{
    epx_param_info_t info = EPX_PARAM_INFO_INIT;
    return epx_param_find(name, &info) == EPX_SUCCESS && !info.is_int ? info.string_value : "";
}

int epx__tool_wait_child(pid_t pid, int64_t deadline_ns)
{
    for (;;) {
        int status = 0;
        pid_t done = waitpid(pid, &status, WNOHANG);
        if (done == pid)
            return status;
        if (done < 0 && errno != EINTR)
            return -1;
        if (epx__tool_now_ns() >= deadline_ns)
            break;
        struct timespec pause = {0, 5 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
    /* A child that leads its own group: this also ends whatever it started. */
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    return -1;
}
