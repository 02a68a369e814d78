/*
 * Child processes for `epx doctor`. The child sends its result lines back as raw
 * fixed-size records through a pipe ("magic, facts size, line count, facts, lines");
 * the parent reads them with a deadline, so a child that hangs inside a driver call
 * costs at most its timeout.
 */
#include "doctor_child.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/tool.h"

#define RESULT_MAGIC 0x65707864u /* "epxd" */

/* In a child: where its stdout and stderr go (-1 in the parent). */
static int capture_fd = -1;

typedef struct {
    uint32_t magic;
    uint32_t facts_size;
    uint32_t count;
} result_header_t;

int epx__doctor_write_all(int fd, const void *data, size_t bytes)
{
    const char *p = data;
    while (bytes > 0) {
        ssize_t written = write(fd, p, bytes);
        if (written < 0 && errno == EINTR)
            continue;
        if (written <= 0)
            return -1;
        p += written;
        bytes -= (size_t)written;
    }
    return 0;
}

int epx__doctor_read_all(int fd, void *data, size_t bytes, int64_t deadline_ns)
{
    char *p = data;
    while (bytes > 0) {
        int64_t left_ms = (deadline_ns - epx__tool_now_ns()) / 1000000;
        if (left_ms <= 0)
            return -1;
        struct pollfd waiting = {fd, POLLIN, 0};
        int ready = poll(&waiting, 1, left_ms > 1000 ? 1000 : (int)left_ms);
        if (ready < 0 && errno != EINTR)
            return -1;
        if (ready <= 0)
            continue;
        ssize_t got = read(fd, p, bytes);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        p += got;
        bytes -= (size_t)got;
    }
    return 0;
}

void epx__doctor_child_output_tail(char *out, size_t out_size)
{
    if (out_size == 0)
        return;
    out[0] = '\0';
    if (capture_fd < 0)
        return;
    fflush(stdout);
    fflush(stderr);
    struct stat info;
    if (fstat(capture_fd, &info) != 0 || info.st_size <= 0)
        return;
    char tail[2048];
    off_t start = info.st_size > (off_t)sizeof(tail) - 1 ? info.st_size - (off_t)sizeof(tail) + 1 : 0;
    ssize_t got = pread(capture_fd, tail, sizeof(tail) - 1, start);
    if (got <= 0)
        return;
    tail[got] = '\0';
    /* The last non-empty line. */
    while (got > 0 && (tail[got - 1] == '\n' || tail[got - 1] == '\r' || tail[got - 1] == ' '))
        tail[--got] = '\0';
    char *line = strrchr(tail, '\n');
    snprintf(out, out_size, "%s", line != NULL ? line + 1 : tail);
}

/* The last line a finished child printed (the parent's view of the capture file). */
static void capture_tail(int fd, char *out, size_t out_size)
{
    int saved = capture_fd;
    capture_fd = fd;
    epx__doctor_child_output_tail(out, out_size);
    capture_fd = saved;
}

static void run_in_child(int result_fd, int output_fd, epx__doctor_child_fn_t fn, void *arg,
                         void *facts, size_t facts_size)
{
    setpgid(0, 0);
    if (output_fd >= 0) {
        dup2(output_fd, 1);
        dup2(output_fd, 2);
        capture_fd = output_fd;
    }
    /* Default signal handling: a parent's handler must not run in the check. */
    signal(SIGPIPE, SIG_DFL);
    epx__doctor_report_t report = EPX__DOCTOR_REPORT_INIT;
    if (facts != NULL && facts_size > 0)
        memset(facts, 0, facts_size);
    fn(&report, arg, facts);
    fflush(stdout);
    fflush(stderr);
    result_header_t header = {RESULT_MAGIC, (uint32_t)facts_size, (uint32_t)report.count};
    int failed = epx__doctor_write_all(result_fd, &header, sizeof(header)) != 0 ||
                 (facts_size > 0 && epx__doctor_write_all(result_fd, facts, facts_size) != 0) ||
                 (report.count > 0 &&
                  epx__doctor_write_all(result_fd, report.lines,
                                        (size_t)report.count * sizeof(*report.lines)) != 0);
    /* _exit: no atexit handlers or stdio flushes inherited from the parent. */
    _exit(failed ? 3 : 0);
}

/* Read the child's result; 0 when it is complete and well formed. */
static int read_result(int fd, int64_t deadline_ns, epx__doctor_report_t *report, void *facts,
                       size_t facts_size)
{
    result_header_t header;
    if (epx__doctor_read_all(fd, &header, sizeof(header), deadline_ns) != 0 ||
        header.magic != RESULT_MAGIC || header.facts_size != facts_size || header.count > 4096)
        return -1;
    if (facts_size > 0 && epx__doctor_read_all(fd, facts, facts_size, deadline_ns) != 0)
        return -1;
    for (uint32_t i = 0; i < header.count; i++) {
        epx__doctor_line_t line;
        if (epx__doctor_read_all(fd, &line, sizeof(line), deadline_ns) != 0)
            return -1;
        epx__doctor_add_line(report, &line);
    }
    return 0;
}

int epx__doctor_run_child(epx__doctor_report_t *report, const char *name, double timeout_s,
                          epx__doctor_child_fn_t fn, void *arg, void *facts, size_t facts_size)
{
    char output_path[] = "/tmp/epx-doctor-XXXXXX";
    int output_fd = mkstemp(output_path);
    if (output_fd >= 0)
        unlink(output_path); /* only the descriptors keep it */
    int result_pipe[2];
    if (pipe(result_pipe) != 0) {
        epx__doctor_add(report, name, EPX__DOCTOR_FAIL, "free file descriptors and run again",
                        "cannot create a pipe for the check: %s", strerror(errno));
        if (output_fd >= 0)
            close(output_fd);
        return EPX__DOCTOR_CHILD_CRASHED;
    }
    fflush(stdout);
    fflush(stderr);
    int64_t deadline = epx__tool_now_ns() + (int64_t)(timeout_s * 1e9);
    pid_t pid = fork();
    if (pid == 0) {
        close(result_pipe[0]);
        run_in_child(result_pipe[1], output_fd, fn, arg, facts, facts_size);
    }
    close(result_pipe[1]);
    if (pid < 0) {
        epx__doctor_add(report, name, EPX__DOCTOR_FAIL, "free memory or processes and run again",
                        "cannot fork a process for the check: %s", strerror(errno));
        close(result_pipe[0]);
        if (output_fd >= 0)
            close(output_fd);
        return EPX__DOCTOR_CHILD_CRASHED;
    }
    setpgid(pid, pid); /* also here, so that a kill cannot race the child's own call */

    /* Lines are appended to a scratch report first: a half-sent result is discarded. */
    epx__doctor_report_t received = EPX__DOCTOR_REPORT_INIT;
    int read_ok = read_result(result_pipe[0], deadline, &received, facts, facts_size) == 0;
    close(result_pipe[0]);
    int status = epx__tool_wait_child(pid, read_ok ? epx__tool_now_ns() + 5000000000LL : deadline);
    int outcome = EPX__DOCTOR_CHILD_DONE;
    if (read_ok && status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        for (int i = 0; i < received.count; i++)
            epx__doctor_add_line(report, &received.lines[i]);
    } else {
        char tail[512] = "";
        if (output_fd >= 0)
            capture_tail(output_fd, tail, sizeof(tail));
        char what[128];
        if (status < 0) {
            snprintf(what, sizeof(what), "did not finish within %.0f s and was stopped",
                     timeout_s);
            outcome = EPX__DOCTOR_CHILD_TIMED_OUT;
        } else if (WIFSIGNALED(status)) {
            snprintf(what, sizeof(what), "crashed (signal %d, %s)", WTERMSIG(status),
                     strsignal(WTERMSIG(status)));
            outcome = EPX__DOCTOR_CHILD_CRASHED;
        } else {
            snprintf(what, sizeof(what), "ended without a result (exit status %d)",
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
            outcome = EPX__DOCTOR_CHILD_CRASHED;
        }
        epx__doctor_add(report, name, EPX__DOCTOR_FAIL,
                        outcome == EPX__DOCTOR_CHILD_TIMED_OUT
                            ? "a driver or library call hangs here: check `nvidia-smi` and "
                              "`dmesg` for GPU errors, then run `epx doctor` again"
                            : "a driver or library call crashes here: reinstall the NVIDIA "
                              "driver or the library named above, then run `epx doctor` again",
                        "this check %s%s%s", what, tail[0] != '\0' ? "; it printed last: " : "",
                        tail);
    }
    epx__doctor_report_free(&received);
    if (output_fd >= 0)
        close(output_fd);
    return outcome;
}

int epx__doctor_find_in_path(const char *name, char *out, size_t out_size)
{
    const char *path = getenv("PATH");
    if (path == NULL || *path == '\0')
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path != '\0') {
        const char *end = strchr(path, ':');
        size_t length = end != NULL ? (size_t)(end - path) : strlen(path);
        if (length > 0) {
            snprintf(out, out_size, "%.*s/%s", (int)length, path, name);
            struct stat info;
            if (stat(out, &info) == 0 && S_ISREG(info.st_mode) && access(out, X_OK) == 0)
                return 1;
        }
        path += length;
        if (*path == ':')
            path++;
    }
    if (out_size > 0)
        out[0] = '\0';
    return 0;
}

/* Append what is readable on `fd` to out (cut to fit); 0 at EOF or error, 1 otherwise. */
static int drain(int fd, char *out, size_t out_size, size_t *used)
{
    char chunk[4096];
    ssize_t got = read(fd, chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR)
        return 1;
    if (got <= 0)
        return 0;
    if (out != NULL && out_size > 0 && *used + 1 < out_size) {
        size_t room = out_size - 1 - *used;
        size_t take = (size_t)got < room ? (size_t)got : room;
        memcpy(out + *used, chunk, take);
        *used += take;
        out[*used] = '\0';
    }
    return 1;
}

int epx__doctor_run_program(char *const argv[], const char *input, char *output,
                            size_t output_size, char *errors, size_t errors_size,
                            double timeout_s, int *timed_out)
{
    if (timed_out != NULL)
        *timed_out = 0;
    if (output != NULL && output_size > 0)
        output[0] = '\0';
    if (errors != NULL && errors_size > 0)
        errors[0] = '\0';
    int in_pipe[2], out_pipe[2], err_pipe[2];
    if (pipe(in_pipe) != 0)
        return -1;
    if (pipe(out_pipe) != 0) {
        close(in_pipe[0]);
        close(in_pipe[1]);
        return -1;
    }
    if (pipe(err_pipe) != 0) {
        close(in_pipe[0]);
        close(in_pipe[1]);
        close(out_pipe[0]);
        close(out_pipe[1]);
        return -1;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        dup2(in_pipe[0], 0);
        dup2(out_pipe[1], 1);
        dup2(err_pipe[1], 2);
        close(in_pipe[0]);
        close(in_pipe[1]);
        close(out_pipe[0]);
        close(out_pipe[1]);
        close(err_pipe[0]);
        close(err_pipe[1]);
        signal(SIGPIPE, SIG_DFL);
        execvp(argv[0], argv);
        dprintf(2, "cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(in_pipe[0]);
    close(out_pipe[1]);
    close(err_pipe[1]);
    if (pid < 0) {
        close(in_pipe[1]);
        close(out_pipe[0]);
        close(err_pipe[0]);
        return -1;
    }
    setpgid(pid, pid);
    if (input != NULL) {
        /* Small inputs only (control commands): they fit in the pipe, so no deadlock. */
        void (*previous)(int) = signal(SIGPIPE, SIG_IGN);
        epx__doctor_write_all(in_pipe[1], input, strlen(input));
        signal(SIGPIPE, previous);
    }
    close(in_pipe[1]);

    int64_t deadline = epx__tool_now_ns() + (int64_t)(timeout_s * 1e9);
    size_t out_used = 0, err_used = 0;
    int out_open = 1, err_open = 1;
    while ((out_open || err_open) && epx__tool_now_ns() < deadline) {
        struct pollfd fds[2] = {{out_open ? out_pipe[0] : -1, POLLIN, 0},
                                {err_open ? err_pipe[0] : -1, POLLIN, 0}};
        int64_t left_ms = (deadline - epx__tool_now_ns()) / 1000000;
        int ready = poll(fds, 2, left_ms > 1000 ? 1000 : (int)(left_ms > 0 ? left_ms : 1));
        if (ready < 0 && errno != EINTR)
            break;
        if (ready <= 0)
            continue;
        if (out_open && (fds[0].revents & (POLLIN | POLLHUP | POLLERR)))
            out_open = drain(out_pipe[0], output, output_size, &out_used);
        if (err_open && (fds[1].revents & (POLLIN | POLLHUP | POLLERR)))
            err_open = drain(err_pipe[0], errors, errors_size, &err_used);
    }
    close(out_pipe[0]);
    close(err_pipe[0]);
    int status = epx__tool_wait_child(pid, out_open || err_open ? epx__tool_now_ns() : deadline);
    if (status < 0) {
        if (timed_out != NULL)
            *timed_out = 1;
        return -1;
    }
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}
