/*
 * Starting and supervising the ranks of `epx launch`.
 *
 * Each rank runs in a process group of its own, so that stopping a rank also stops
 * whatever it started (a shell's `sleep`, a helper process): otherwise a grandchild
 * could keep the rank's output pipe open and the launcher waiting. Because the ranks
 * are not in the terminal's foreground group, the launcher forwards SIGINT and SIGTERM
 * itself.
 *
 * One poll loop watches every output pipe and a self-pipe that the signal handler
 * writes to (SIGCHLD, SIGINT, SIGTERM), so the loop wakes for output, for a rank's
 * exit and for signals alike, and never blocks past the next deadline (the overall
 * timeout, or the SIGKILL that follows a SIGTERM after a grace period).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/tool.h"
#include "launch.h"

/* After SIGTERM, ranks get this long to exit before SIGKILL. */
#define KILL_GRACE_NS 3000000000LL
/* A line longer than this is forwarded in pieces (each with the prefix). */
#define LINE_LIMIT 65536
/* After the last rank exited, wait this long for output still in flight. */
#define FINAL_DRAIN_NS 200000000LL
#define READ_CHUNK 65536

typedef struct {
    int rank;   /* whose output this is */
    int fd;     /* read end of the pipe; -1 once closed */
    int target; /* 1 (stdout) or 2 (stderr) */
    int prefix; /* write "[rank r] " before each line */
    char *data; /* an incomplete line waiting for its newline */
    size_t length;
    size_t capacity;
} stream_t;

typedef struct {
    int rank;
    pid_t pid; /* 0 if never started */
    int running;
    int stopped_by_launcher; /* a signal from the launcher reached it while running */
    stream_t streams[2];
} rank_t;

typedef struct {
    const epx__launch_options_t *options;
    rank_t *ranks;
    int running_count;
    int failure_status; /* first failing rank's exit status; -1 while none */
    int launcher_signal; /* first SIGINT/SIGTERM the launcher received; 0 if none */
    int timed_out;
    int64_t deadline_ns; /* overall timeout; 0 = none */
    int64_t kill_at_ns;  /* when to SIGKILL the ranks still running; 0 = not planned */
} monitor_t;

static int signal_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char byte = (unsigned char)sig;
    ssize_t written = write(signal_pipe[1], &byte, 1);
    (void)written; /* a full pipe already holds a wake-up; nothing else to do here */
    errno = saved;
}

/* ---------------------------------------------------------------- output */

static void write_all(int fd, const char *data, size_t length)
{
    while (length > 0) {
        ssize_t written = write(fd, data, length);
        if (written < 0) {
            if (errno == EINTR)
                continue;
            return; /* the reader went away (closed terminal, `| head`): drop the output */
        }
        data += written;
        length -= (size_t)written;
    }
}

/* Write `length` bytes that end with a newline, one prefix per line. */
static void emit_lines(const stream_t *stream, const char *data, size_t length)
{
    if (!stream->prefix) {
        write_all(stream->target, data, length);
        return;
    }
    char prefix[32];
    int prefix_length = snprintf(prefix, sizeof(prefix), "[rank %d] ", stream->rank);
    size_t lines = 0;
    for (size_t i = 0; i < length; i++)
        lines += data[i] == '\n';
    char *out = malloc(length + lines * (size_t)prefix_length);
    if (out == NULL) {
        write_all(stream->target, data, length); /* unprefixed beats lost */
        return;
    }
    size_t used = 0;
    const char *line = data;
    const char *end = data + length;
    while (line < end) {
        const char *newline = memchr(line, '\n', (size_t)(end - line));
        size_t line_length = (size_t)(newline - line) + 1;
        memcpy(out + used, prefix, (size_t)prefix_length);
        used += (size_t)prefix_length;
        memcpy(out + used, line, line_length);
        used += line_length;
        line += line_length;
    }
    write_all(stream->target, out, used);
    free(out);
}

/* Forward the incomplete line as a line of its own (at EOF, or when it grew too long). */
static void flush_partial(stream_t *stream)
{
    if (stream->length == 0)
        return;
    stream->data[stream->length++] = '\n'; /* capacity always keeps one byte spare */
    emit_lines(stream, stream->data, stream->length);
    stream->length = 0;
}

/* Add bytes read from the pipe: forward complete lines, keep the rest. */
static void consume(stream_t *stream, const char *data, size_t length)
{
    if (stream->length + length + 1 > stream->capacity) {
        size_t capacity = stream->capacity ? stream->capacity : 4096;
        while (capacity < stream->length + length + 1)
            capacity *= 2;
        char *grown = realloc(stream->data, capacity);
        if (grown == NULL) {
            /* No room to join the pieces of a line: forward what we have as it is. */
            flush_partial(stream);
            write_all(stream->target, data, length);
            return;
        }
        stream->data = grown;
        stream->capacity = capacity;
    }
    memcpy(stream->data + stream->length, data, length);
    stream->length += length;

    size_t complete = 0;
    for (size_t i = stream->length; i > 0; i--) {
        if (stream->data[i - 1] == '\n') {
            complete = i;
            break;
        }
    }
    if (complete > 0) {
        emit_lines(stream, stream->data, complete);
        memmove(stream->data, stream->data + complete, stream->length - complete);
        stream->length -= complete;
    }
    if (stream->length > LINE_LIMIT)
        flush_partial(stream);
}

static void close_stream(stream_t *stream)
{
    flush_partial(stream);
    if (stream->fd >= 0)
        close(stream->fd);
    stream->fd = -1;
}

/* One read. Returns 1 after data, 0 when nothing is there now, -1 once closed. */
static int read_stream(stream_t *stream)
{
    if (stream->fd < 0)
        return -1;
    char chunk[READ_CHUNK];
    for (;;) {
        ssize_t got = read(stream->fd, chunk, sizeof(chunk));
        if (got > 0) {
            consume(stream, chunk, (size_t)got);
            return 1;
        }
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        close_stream(stream); /* EOF, or an error that reading again will not fix */
        return -1;
    }
}

/* Forward everything the pipe holds now (a rank that exited wrote its last words). */
static void drain_stream(stream_t *stream)
{
    while (read_stream(stream) == 1) {
    }
}

/* ---------------------------------------------------------------- ranks */

static void signal_rank(rank_t *rank, int sig)
{
    if (!rank->running)
        return;
    /* The rank leads its own process group; signal the group to reach its children.
     * If the group is not there (the rank had not reached setpgid), signal the rank. */
    if (kill(-rank->pid, sig) != 0)
        kill(rank->pid, sig);
    rank->stopped_by_launcher = 1;
}

static void signal_all(monitor_t *monitor, int sig)
{
    for (int r = 0; r < monitor->options->num_ranks; r++)
        signal_rank(&monitor->ranks[r], sig);
}

/* SIGTERM now, SIGKILL after the grace period for any rank that ignores it. */
static void stop_all(monitor_t *monitor, int sig)
{
    signal_all(monitor, sig);
    int64_t kill_at = epx__tool_now_ns() + KILL_GRACE_NS;
    if (monitor->kill_at_ns == 0 || kill_at < monitor->kill_at_ns)
        monitor->kill_at_ns = kill_at;
}

/* In the child: become the rank. Never returns. */
static void exec_rank(const epx__launch_options_t *options, int rank, const char *unique_id,
                      int stdout_fd, int stderr_fd)
{
    setpgid(0, 0);
    /* The launcher's handlers would report a signal meant for this rank as one for the
     * launcher (they write to the shared self-pipe), and exec keeps ignored signals
     * ignored: back to the defaults, then unblock (the parent blocked them for fork). */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);

    /* Ranks run in the background (own process group), so reading the terminal would
     * stop them: they get an empty stdin. */
    int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0 && null_fd != 0) {
        dup2(null_fd, 0);
        close(null_fd);
    }
    dup2(stdout_fd, 1);
    dup2(stderr_fd, 2);

    char number[32];
    snprintf(number, sizeof(number), "%d", rank);
    setenv("EPX_RANK", number, 1);
    setenv("EPX_LOCAL_RANK", number, 1); /* one machine: every rank is local */
    snprintf(number, sizeof(number), "%d", options->num_ranks);
    setenv("EPX_WORLD_SIZE", number, 1);
    setenv("EPX_UNIQUE_ID", unique_id, 1);
    if (options->ranks_per_node > 0) {
        snprintf(number, sizeof(number), "%d", options->ranks_per_node);
        setenv("EPX_RANKS_PER_NODE", number, 1);
    }
    if (options->backend != NULL)
        setenv("EPX_BACKEND", options->backend, 1);
    /* Multicast objects fail when several ranks share one GPU (docs/DESIGN.md section 4). */
    setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
    setenv("NCCL_NVLS_ENABLE", "0", 0);

    execvp(options->argv[0], options->argv);
    dprintf(2, "epx launch: cannot run '%s': %s\n", options->argv[0], strerror(errno));
    _exit(127);
}

static int start_rank(monitor_t *monitor, int r, const char *unique_id)
{
    rank_t *rank = &monitor->ranks[r];
    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0) {
        fprintf(stderr, "epx launch: pipe for rank %d: %s\n", r, strerror(errno));
        return -1;
    }
    if (pipe2(err_pipe, O_CLOEXEC) != 0) {
        fprintf(stderr, "epx launch: pipe for rank %d: %s\n", r, strerror(errno));
        close(out_pipe[0]);
        close(out_pipe[1]);
        return -1;
    }
    /* Until the child has reset its handlers, a signal must wait (see exec_rank). */
    sigset_t blocked, previous;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGINT);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGCHLD);
    sigprocmask(SIG_BLOCK, &blocked, &previous);
    pid_t pid = fork();
    if (pid == 0)
        exec_rank(monitor->options, r, unique_id, out_pipe[1], err_pipe[1]);
    int fork_errno = errno;
    sigprocmask(SIG_SETMASK, &previous, NULL);
    if (pid < 0) {
        fprintf(stderr, "epx launch: fork for rank %d: %s\n", r, strerror(fork_errno));
        close(out_pipe[0]);
        close(out_pipe[1]);
        close(err_pipe[0]);
        close(err_pipe[1]);
        return -1;
    }
    /* Also set the group here, so that a signal sent right away reaches the group. */
    setpgid(pid, pid);
    close(out_pipe[1]);
    close(err_pipe[1]);
    fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
    rank->pid = pid;
    rank->running = 1;
    rank->streams[0].fd = out_pipe[0];
    rank->streams[1].fd = err_pipe[0];
    monitor->running_count++;
    return 0;
}

static void rank_exited(monitor_t *monitor, rank_t *rank, int wait_status)
{
    rank->running = 0;
    monitor->running_count--;
    /* Its last output comes before the news of its exit. */
    drain_stream(&rank->streams[0]);
    drain_stream(&rank->streams[1]);

    if (WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0)
        return;
    int status;
    const char *after = rank->stopped_by_launcher ? " (after epx launch stopped it)" : "";
    if (WIFSIGNALED(wait_status)) {
        int sig = WTERMSIG(wait_status);
        status = 128 + sig;
        fprintf(stderr, "epx launch: rank %d killed by signal %d (%s)%s\n", rank->rank, sig,
                strsignal(sig), after);
    } else {
        status = WEXITSTATUS(wait_status);
        fprintf(stderr, "epx launch: rank %d exited with status %d%s\n", rank->rank, status,
                after);
    }
    if (monitor->failure_status < 0)
        monitor->failure_status = status;
    if (monitor->running_count > 0 && !rank->stopped_by_launcher) {
        fprintf(stderr, "epx launch: stopping the other ranks\n");
        stop_all(monitor, SIGTERM);
    }
}

static void reap(monitor_t *monitor)
{
    for (;;) {
        int wait_status;
        pid_t pid = waitpid(-1, &wait_status, WNOHANG);
        if (pid < 0 && errno == EINTR)
            continue;
        if (pid <= 0)
            return;
        for (int r = 0; r < monitor->options->num_ranks; r++) {
            rank_t *rank = &monitor->ranks[r];
            if (rank->running && rank->pid == pid) {
                rank_exited(monitor, rank, wait_status);
                break;
            }
        }
    }
}

/* ---------------------------------------------------------------- the loop */

static void check_deadlines(monitor_t *monitor, int64_t now)
{
    if (monitor->deadline_ns != 0 && !monitor->timed_out && now >= monitor->deadline_ns) {
        monitor->timed_out = 1;
        char list[1024] = "";
        size_t used = 0;
        for (int r = 0; r < monitor->options->num_ranks && used + 16 < sizeof(list); r++) {
            if (monitor->ranks[r].running)
                used += (size_t)snprintf(list + used, sizeof(list) - used, " %d", r);
        }
        fprintf(stderr, "epx launch: timeout after %g s; ranks still running:%s\n",
                monitor->options->timeout_s, list);
        stop_all(monitor, SIGTERM);
    }
    if (monitor->kill_at_ns != 0 && now >= monitor->kill_at_ns) {
        monitor->kill_at_ns = 0;
        signal_all(monitor, SIGKILL);
    }
}

static int poll_timeout_ms(const monitor_t *monitor, int64_t now)
{
    /* Wake at least once a second even without a deadline, as a guard against a
     * wake-up lost between the signal handler and poll. */
    int64_t wait_ns = 1000000000LL;
    if (monitor->deadline_ns != 0 && !monitor->timed_out && monitor->deadline_ns - now < wait_ns)
        wait_ns = monitor->deadline_ns - now;
    if (monitor->kill_at_ns != 0 && monitor->kill_at_ns - now < wait_ns)
        wait_ns = monitor->kill_at_ns - now;
    if (wait_ns < 0)
        wait_ns = 0;
    return (int)((wait_ns + 999999) / 1000000);
}

static void handle_signals(monitor_t *monitor)
{
    unsigned char bytes[64];
    ssize_t got;
    while ((got = read(signal_pipe[0], bytes, sizeof(bytes))) > 0) {
        for (ssize_t i = 0; i < got; i++) {
            int sig = bytes[i];
            if (sig != SIGINT && sig != SIGTERM)
                continue; /* SIGCHLD: reap() runs after every wake-up */
            if (monitor->launcher_signal == 0) {
                monitor->launcher_signal = sig;
                fprintf(stderr, "epx launch: got %s, passing it to the ranks\n", strsignal(sig));
                stop_all(monitor, sig);
            } else {
                /* Asked twice: the user wants it over now. */
                signal_all(monitor, SIGKILL);
            }
        }
    }
}

/*
 * Poll every open stream (and the signal pipe when `with_signals`) for up to
 * `timeout_ms`, and read from the ones that are ready.
 */
static void poll_once(monitor_t *monitor, struct pollfd *fds, stream_t **owners,
                      int with_signals, int timeout_ms)
{
    int count = 0;
    if (with_signals) {
        fds[count].fd = signal_pipe[0];
        fds[count].events = POLLIN;
        owners[count++] = NULL;
    }
    for (int r = 0; r < monitor->options->num_ranks; r++) {
        for (int s = 0; s < 2; s++) {
            stream_t *stream = &monitor->ranks[r].streams[s];
            if (stream->fd < 0)
                continue;
            fds[count].fd = stream->fd;
            fds[count].events = POLLIN;
            owners[count++] = stream;
        }
    }
    int ready = poll(fds, (nfds_t)count, timeout_ms);
    if (ready <= 0)
        return; /* timeout, or EINTR: the caller's loop looks again */
    for (int i = 0; i < count; i++) {
        if (fds[i].revents == 0)
            continue;
        if (owners[i] == NULL) {
            handle_signals(monitor);
            continue;
        }
        read_stream(owners[i]);
    }
}

static void supervise(monitor_t *monitor, struct pollfd *fds, stream_t **owners)
{
    while (monitor->running_count > 0) {
        int64_t now = epx__tool_now_ns();
        check_deadlines(monitor, now);
        poll_once(monitor, fds, owners, 1, poll_timeout_ms(monitor, now));
        handle_signals(monitor);
        reap(monitor);
    }
    /* Every rank has exited; forward what their pipes still hold. A pipe a rank's
     * background child keeps open is let go after a short wait. */
    int64_t give_up = epx__tool_now_ns() + FINAL_DRAIN_NS;
    for (;;) {
        int open = 0;
        for (int r = 0; r < monitor->options->num_ranks; r++)
            open += (monitor->ranks[r].streams[0].fd >= 0) + (monitor->ranks[r].streams[1].fd >= 0);
        int64_t left = give_up - epx__tool_now_ns();
        if (open == 0 || left <= 0)
            break;
        poll_once(monitor, fds, owners, 0, (int)(left / 1000000) + 1);
    }
}

static int install_handlers(struct sigaction *saved)
{
    if (pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        fprintf(stderr, "epx launch: pipe: %s\n", strerror(errno));
        return -1;
    }
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &action, &saved[0]);
    sigaction(SIGINT, &action, &saved[1]);
    sigaction(SIGTERM, &action, &saved[2]);
    /* A closed stdout must not kill the launcher while ranks still run. */
    struct sigaction ignore;
    memset(&ignore, 0, sizeof(ignore));
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, &saved[3]);
    return 0;
}

static void restore_handlers(const struct sigaction *saved)
{
    sigaction(SIGCHLD, &saved[0], NULL);
    sigaction(SIGINT, &saved[1], NULL);
    sigaction(SIGTERM, &saved[2], NULL);
    sigaction(SIGPIPE, &saved[3], NULL);
    close(signal_pipe[0]);
    close(signal_pipe[1]);
    signal_pipe[0] = signal_pipe[1] = -1;
}

int epx__launch_ranks(const epx__launch_options_t *options, const char *unique_id)
{
    int n = options->num_ranks;
    monitor_t monitor = {options, NULL, 0, -1, 0, 0, 0, 0};
    monitor.ranks = calloc((size_t)n, sizeof(rank_t));
    struct pollfd *fds = calloc((size_t)(2 * n + 1), sizeof(struct pollfd));
    stream_t **owners = calloc((size_t)(2 * n + 1), sizeof(stream_t *));
    if (monitor.ranks == NULL || fds == NULL || owners == NULL) {
        fprintf(stderr, "epx launch: out of memory for %d ranks\n", n);
        free(monitor.ranks);
        free(fds);
        free(owners);
        return 1;
    }
    for (int r = 0; r < n; r++) {
        monitor.ranks[r].rank = r;
        for (int s = 0; s < 2; s++) {
            monitor.ranks[r].streams[s].rank = r;
            monitor.ranks[r].streams[s].fd = -1;
            monitor.ranks[r].streams[s].target = s + 1;
            monitor.ranks[r].streams[s].prefix = s == 1 || options->prefix_stdout;
        }
    }
    struct sigaction saved[4];
    if (install_handlers(saved) != 0) {
        free(monitor.ranks);
        free(fds);
        free(owners);
        return 1;
    }
    fflush(stdout); /* the ranks' output must not overtake what the launcher printed */

    int start_failed = 0;
    if (options->timeout_s > 0)
        monitor.deadline_ns = epx__tool_now_ns() + (int64_t)(options->timeout_s * 1e9);
    for (int r = 0; r < n && !start_failed; r++)
        start_failed = start_rank(&monitor, r, unique_id) != 0;
    if (start_failed && monitor.running_count > 0)
        stop_all(&monitor, SIGTERM);

    supervise(&monitor, fds, owners);

    for (int r = 0; r < n; r++) {
        for (int s = 0; s < 2; s++) {
            close_stream(&monitor.ranks[r].streams[s]);
            free(monitor.ranks[r].streams[s].data);
        }
    }
    restore_handlers(saved);
    free(monitor.ranks);
    free(fds);
    free(owners);

    if (monitor.timed_out)
        return EPX__LAUNCH_TIMEOUT_STATUS;
    if (start_failed)
        return 1;
    if (monitor.failure_status >= 0)
        return monitor.failure_status;
    if (monitor.launcher_signal != 0)
        return 128 + monitor.launcher_signal;
    return 0;
}
