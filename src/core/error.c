/*
 * Status codes and the per-thread "last error" text.
 *
 * A failure is described once, where it is first seen, by EPX_ERROR: the text goes to a
 * thread-local buffer (so concurrent callers on different threads each read their own
 * failure through epx_last_error) and to the log at WARN level with the file and line.
 * Callers further up only propagate the status (EPX_CHECK), so the message is never
 * overwritten by a vaguer one.
 */
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "core/core_private.h"

#define EPX__ERROR_TEXT_BYTES 1024

static _Thread_local char epx__last_error_text[EPX__ERROR_TEXT_BYTES];

epx_status_t epx__error(epx_status_t status, const char *file, int line, const char *fmt, ...)
{
    char *text = epx__last_error_text;
    va_list args;
    va_start(args, fmt);
    int written = vsnprintf(text, EPX__ERROR_TEXT_BYTES, fmt, args);
    va_end(args);
    if (written < 0) {
        snprintf(text, EPX__ERROR_TEXT_BYTES, "(unformattable error message \"%s\")", fmt);
    } else if (written >= EPX__ERROR_TEXT_BYTES) {
        /* Mark the cut so that a reader does not take a truncated message as whole. */
        memcpy(text + EPX__ERROR_TEXT_BYTES - 4, "...", 4);
    }

    epx_log_subsys_t subsys = epx__log_subsys_of_file(file);
    if (epx__log_enabled(EPX_LOG_WARN, subsys))
        epx__log(EPX_LOG_WARN, subsys, file, line, "%s [%s]", text, epx_status_name(status));
    return status;
}

void epx__clear_error(void)
{
    epx__last_error_text[0] = '\0';
}

const char *epx_last_error(void)
{
    return epx__last_error_text;
}

const char *epx_status_string(epx_status_t status)
{
    switch (status) {
#define EPX_STATUS_STRING_(name, value, text) \
    case EPX_##name:                          \
        return text;
        EPX_STATUS_MAP(EPX_STATUS_STRING_)
#undef EPX_STATUS_STRING_
    }
    return "unknown status";
}

const char *epx_status_name(epx_status_t status)
{
    switch (status) {
#define EPX_STATUS_NAME_(name, value, text) \
    case EPX_##name:                        \
        return "EPX_" #name;
        EPX_STATUS_MAP(EPX_STATUS_NAME_)
#undef EPX_STATUS_NAME_
    }
    return "EPX_UNKNOWN_STATUS";
}

int epx_version(void)
{
    return EPX_VERSION_CODE;
}
