/*
 * The soak's rejoin (--rejoin-after, with --inject kill): how the replacement of a killed
 * rank is started and how it finds the survivors (docs/STABILITY.md).
 *
 * The process `epx launch` started for the victim's rank never takes part itself: at the
 * start of the soak it forks the rank's real process (the victim) and waits for it. When
 * the victim kills itself it first writes, into a pipe to that parent, the unique id of
 * the rejoin's group (rank 0 made it and sent it to every rank in the control words of
 * the injection). Half-way through --rejoin-after the parent starts the replacement:
 * this same program, exec'd afresh with the same arguments plus `--soak-rejoin ID`, so
 * it is a new process in every sense (new pid, new library state), and exits with its
 * status. `epx launch`
 * sees nothing but a rank that runs until the end. The survivors keep serving with the
 * rank masked for --rejoin-after, then all of them and the replacement form the group
 * and rejoin (epx_ll_rejoin / epx_buffer_create_rejoin).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_soak.h"
#include "common/tool.h"

/* This process's own command line, as argv (NULL-terminated; one allocation). */
static char **own_argv(void)
{
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    size_t size = 0, capacity = 4096;
    char *text = malloc(capacity);
    ssize_t got = 0;
    while (text != NULL && (got = read(fd, text + size, capacity - size)) > 0) {
        size += (size_t)got;
        if (size == capacity) {
            char *grown = realloc(text, capacity *= 2);
            if (grown == NULL)
                free(text);
            text = grown;
        }
    }
    close(fd);
    if (text == NULL || size == 0) {
        free(text);
        return NULL;
    }
    int count = 0;
    for (size_t i = 0; i < size; i++)
        count += text[i] == '\0';
    /* The pointers first, then the text they point into, so one free() releases all. */
    char **argv = malloc((size_t)(count + 3) * sizeof(char *) + size);
    if (argv == NULL) {
        free(text);
        return NULL;
    }
    char *copy = (char *)(argv + count + 3);
    memcpy(copy, text, size);
    free(text);
    int index = 0;
    for (size_t i = 0; i < size && index < count; i += strlen(copy + i) + 1)
        argv[index++] = copy + i;
    argv[index] = NULL;
    return argv;
}

/* In the parent: start the replacement with the rejoin's group id and wait for it. */
static int run_replacement(const char *id)
{
    char **argv = own_argv();
    if (argv == NULL) {
        fprintf(stderr, "epx bench: soak: cannot read this process's command line to start a "
                        "replacement\n");
        return 1;
    }
    int argc = 0;
    while (argv[argc] != NULL)
        argc++;
    argv[argc++] = "--soak-rejoin";
    argv[argc++] = (char *)id;
    argv[argc] = NULL;
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "epx bench: soak: fork: cannot start a replacement: %s\n",
                strerror(errno));
        free(argv);
        return 1;
    }
    if (child == 0) {
        execv("/proc/self/exe", argv);
        fprintf(stderr, "epx bench: soak: cannot exec the replacement: %s\n", strerror(errno));
        _exit(127);
    }
    free(argv);
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int epx__soak_fork_victim(const epx__soak_options_t *so)
{
    int pipe_fds[2] = {-1, -1};
    if (so->rejoin_after_s > 0 && pipe2(pipe_fds, O_CLOEXEC) != 0) {
        fprintf(stderr, "epx bench: soak: pipe: %s\n", strerror(errno));
        exit(1);
    }
    fflush(stdout);
    fflush(stderr);
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "epx bench: soak: fork: cannot run the victim apart\n");
        exit(1);
    }
    if (child == 0) {
        if (pipe_fds[0] >= 0)
            close(pipe_fds[0]);
        return pipe_fds[1];
    }
    if (pipe_fds[1] >= 0)
        close(pipe_fds[1]);
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR)
        ;
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL))
        _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    /* Died as planned. An id in the pipe asks for a replacement. */
    char id[EPX__SOAK_ID_BYTES] = "";
    size_t length = 0;
    while (pipe_fds[0] >= 0 && length < sizeof(id) - 1) {
        ssize_t got = read(pipe_fds[0], id + length, sizeof(id) - 1 - length);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break; /* end of file: the victim is gone */
        length += (size_t)got;
    }
    id[length] = '\0';
    if (length == 0)
        _exit(0);
    /* Half-way through --rejoin-after: the replacement waits for the survivors, who come
     * at the round planned for the whole of it (a rate estimate, so early or late). */
    struct timespec pause = {(time_t)(so->rejoin_after_s / 2),
                             (long)(fmod(so->rejoin_after_s / 2, 1.0) * 1e9)};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR)
        ;
    fprintf(stderr, "epx bench: soak: rank %d: starting a replacement process\n",
            so->inject_rank);
    _exit(run_replacement(id));
}

void epx__soak_report_rejoin(int fd, const char *id)
{
    if (fd < 0 || id == NULL || id[0] == '\0')
        return;
    size_t length = strlen(id), done = 0;
    while (done < length) {
        ssize_t wrote = write(fd, id + done, length - done);
        if (wrote < 0 && errno == EINTR)
            continue;
        if (wrote <= 0)
            return; /* no replacement then: the survivors' rejoin fails and says so */
        done += (size_t)wrote;
    }
}

epx_status_t epx__soak_rejoin_group(const char *id_text, int rank, int world, double wait_s,
                                    epx_group_t *group)
{
    epx_unique_id_t id;
    epx_status_t status = epx_unique_id_from_string(id_text, &id);
    if (status != EPX_SUCCESS)
        return status;
    epx_group_config_t config = EPX_GROUP_CONFIG_INIT;
    config.rank = rank;
    config.world_size = world;
    config.backend = EPX_BACKEND_HOST;
    config.unique_id = &id;
    /* The replacement starts at once and waits for the survivors, which come after
     * --rejoin-after: each attempt ends within the group's timeout, so try again until
     * they must have come. */
    int64_t deadline = epx__tool_now_ns() + (int64_t)(wait_s * 1e9);
    for (;;) {
        status = epx_group_create(&config, group);
        if (status != EPX_ERR_TIMEOUT || epx__tool_now_ns() >= deadline)
            return status;
    }
}
