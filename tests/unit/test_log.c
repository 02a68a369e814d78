/*
 * The logger: line format, level and subsystem filters, EPX_LOG_FILE with %p and %r
 * (and after fork), the fallback to stderr, and whole lines from concurrent threads.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/core.h"
#include "core/core_private.h"
#include "core_test_env.h"
#include "test_util.h"

static const char *scratch;

/* Point the logger at `pattern` (inside the scratch dir) with the given level/subsys. */
static void configure(const char *pattern, const char *level, const char *subsys)
{
    unset_epx_environment();
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", scratch, pattern);
    setenv("EPX_LOG_FILE", path, 1);
    if (level != NULL)
        setenv("EPX_LOG_LEVEL", level, 1);
    if (subsys != NULL)
        setenv("EPX_LOG_SUBSYS", subsys, 1);
    epx__params_reset();
}

static char *read_scratch_file(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", scratch, name);
    char *text = read_text_file(path);
    remove(path);
    return text;
}

static void test_format_and_levels(void)
{
    epx__log_set_rank(-1);
    configure("epx-%p.log", "info", NULL);
    CHECK(epx__log_enabled(EPX_LOG_INFO, EPX_SUBSYS_OPS));
    CHECK(!epx__log_enabled(EPX_LOG_DEBUG, EPX_SUBSYS_OPS));
    CHECK(!epx__log_enabled(EPX_LOG_NONE, EPX_SUBSYS_OPS));

    EPX_INFO(EPX_SUBSYS_OPS, "hello %d", 42);
    int info_line = __LINE__ - 1;
    EPX_DEBUG(EPX_SUBSYS_OPS, "hidden debug line");
    EPX_TRACE(EPX_SUBSYS_CORE, "hidden trace line");
    EPX_WARN(EPX_SUBSYS_TRANSPORT, "a warning\n");
    epx_status_t status = EPX_ERROR(EPX_ERR_INVALID_ARG, "boom %s", "here");
    int error_line = __LINE__ - 1;
    CHECK_EQ_INT(status, EPX_ERR_INVALID_ARG);

    char name[64], host[256], expected[512];
    snprintf(name, sizeof(name), "epx-%ld.log", (long)getpid());
    CHECK(gethostname(host, sizeof(host)) == 0);
    host[strcspn(host, ".")] = '\0';
    char *text = read_scratch_file(name);

    snprintf(expected, sizeof(expected), "epx[%s:%ld:-] INFO ops test_log.c:%d hello 42\n",
             host, (long)getpid(), info_line);
    CHECK(strstr(text, expected) != NULL);
    CHECK(strstr(text, "hidden") == NULL);
    /* The caller's newline does not leave a blank line. */
    CHECK(strstr(text, "WARN transport test_log.c:") != NULL);
    CHECK(strstr(text, "a warning\n\n") == NULL);
    CHECK(strstr(text, "\n\n") == NULL);
    /* EPX_ERROR logs the message once, at WARN, where it was raised. */
    snprintf(expected, sizeof(expected),
             "WARN core test_log.c:%d boom here [EPX_ERR_INVALID_ARG]\n", error_line);
    CHECK_EQ_INT(count_occurrences(text, expected), 1);
    CHECK_EQ_INT(count_occurrences(text, "\n"), 3);
    free(text);
    epx__clear_error();
}

static void test_rank_in_name_and_line(void)
{
    configure("rank%r.log", "warn", NULL);
    EPX_WARN(EPX_SUBSYS_CORE, "before the rank");
    epx__log_set_rank(5);
    EPX_WARN(EPX_SUBSYS_CORE, "after the rank");
    epx__log_set_rank(-1);

    char *before = read_scratch_file("rank-.log");
    char *after = read_scratch_file("rank5.log");
    CHECK(strstr(before, ":-] WARN core") != NULL);
    CHECK(strstr(before, "before the rank") != NULL);
    CHECK(strstr(before, "after the rank") == NULL);
    CHECK(strstr(after, ":5] WARN core") != NULL);
    CHECK(strstr(after, "after the rank") != NULL);
    free(before);
    free(after);
}

static void test_subsystem_filter(void)
{
    configure("subsys.log", "trace", "ops,bootstrap");
    CHECK(epx__log_enabled(EPX_LOG_TRACE, EPX_SUBSYS_OPS));
    CHECK(epx__log_enabled(EPX_LOG_ERROR, EPX_SUBSYS_BOOTSTRAP));
    CHECK(!epx__log_enabled(EPX_LOG_ERROR, EPX_SUBSYS_CORE));
    CHECK(!epx__log_enabled(EPX_LOG_ERROR, EPX_SUBSYS_TRANSPORT));
    CHECK(!epx__log_enabled(EPX_LOG_ERROR, EPX_SUBSYS_TOOLS));
    EPX_TRACE(EPX_SUBSYS_BOOTSTRAP, "shown");
    EPX_WARN(EPX_SUBSYS_TRANSPORT, "filtered");
    char *text = read_scratch_file("subsys.log");
    CHECK(strstr(text, "TRACE bootstrap test_log.c:") != NULL);
    CHECK(strstr(text, "filtered") == NULL);
    free(text);

    configure("none.log", "none", NULL);
    CHECK(!epx__log_enabled(EPX_LOG_ERROR, EPX_SUBSYS_ALL));
    EPX_LOG(EPX_LOG_ERROR, EPX_SUBSYS_CORE, "never written");
    text = read_scratch_file("none.log");
    CHECK(strcmp(text, "") == 0);
    free(text);

    /* A bad level is the table's error; the logger itself falls back to warn. */
    configure("bad.log", "loud", "nonsense");
    CHECK(epx__log_enabled(EPX_LOG_WARN, EPX_SUBSYS_TOOLS));
    CHECK(!epx__log_enabled(EPX_LOG_INFO, EPX_SUBSYS_TOOLS));
    free(read_scratch_file("bad.log"));
}

static void test_parsers_and_paths(void)
{
    epx_log_level_t level;
    CHECK(epx__log_parse_level("DEBUG", &level) == 0 && level == EPX_LOG_DEBUG);
    CHECK(epx__log_parse_level("none", &level) == 0 && level == EPX_LOG_NONE);
    CHECK(epx__log_parse_level("verbose", &level) != 0);

    unsigned mask = 0;
    char bad[32];
    CHECK(epx__log_parse_subsys("core", &mask, bad, sizeof(bad)) == 0);
    CHECK_EQ_INT(mask, EPX_SUBSYS_CORE);
    CHECK(epx__log_parse_subsys(" transport , TOOLS ", &mask, bad, sizeof(bad)) == 0);
    CHECK_EQ_INT(mask, EPX_SUBSYS_TRANSPORT | EPX_SUBSYS_TOOLS);
    CHECK(epx__log_parse_subsys("ops,all", &mask, bad, sizeof(bad)) == 0);
    CHECK_EQ_INT(mask, EPX_SUBSYS_ALL);
    CHECK(epx__log_parse_subsys("ops,gpu", &mask, bad, sizeof(bad)) != 0);
    CHECK(strcmp(bad, "gpu") == 0);
    CHECK(epx__log_parse_subsys("", &mask, bad, sizeof(bad)) != 0);

    CHECK_EQ_INT(epx__log_subsys_of_file("/w/src/ops/host/dispatch.c"), EPX_SUBSYS_OPS);
    CHECK_EQ_INT(epx__log_subsys_of_file("/w/src/bootstrap/tcp.c"), EPX_SUBSYS_BOOTSTRAP);
    CHECK_EQ_INT(epx__log_subsys_of_file("src/transport/shm/shm.c"), EPX_SUBSYS_TRANSPORT);
    CHECK_EQ_INT(epx__log_subsys_of_file("/w/src/epx.c"), EPX_SUBSYS_CORE);
    CHECK_EQ_INT(epx__log_subsys_of_file("/home/ops/epx/src/core/log.c"), EPX_SUBSYS_CORE);
    CHECK_EQ_INT(epx__log_subsys_of_file("/w/tools/launch.c"), EPX_SUBSYS_TOOLS);
    CHECK_EQ_INT(epx__log_subsys_of_file(NULL), EPX_SUBSYS_CORE);
}

/* A file that cannot be opened: one warning on stderr, then the lines go there. */
static void test_fallback_to_stderr(void)
{
    unset_epx_environment();
    setenv("EPX_LOG_FILE", "/nonexistent-epx-dir/sub/x.log", 1);
    epx__params_reset();

    char capture[512];
    snprintf(capture, sizeof(capture), "%s/stderr.txt", scratch);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    int fd = open(capture, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(saved >= 0 && fd >= 0);
    CHECK(dup2(fd, STDERR_FILENO) == STDERR_FILENO);
    EPX_WARN(EPX_SUBSYS_CORE, "first line to stderr");
    EPX_WARN(EPX_SUBSYS_CORE, "second line to stderr");
    fflush(stderr);
    CHECK(dup2(saved, STDERR_FILENO) == STDERR_FILENO);
    close(fd);
    close(saved);

    char *text = read_scratch_file("stderr.txt");
    CHECK_EQ_INT(count_occurrences(text, "cannot open EPX_LOG_FILE /nonexistent-epx-dir/sub/x.log"),
                 1);
    CHECK(strstr(text, "logging to stderr") != NULL);
    CHECK(strstr(text, "WARN core test_log.c:") != NULL);
    CHECK(strstr(text, "first line to stderr") != NULL);
    CHECK(strstr(text, "second line to stderr") != NULL);
    free(text);
    unset_epx_environment();
}

/* With %p, a forked child writes to a file of its own. */
static void test_fork_reopens_per_pid(void)
{
    configure("fork-%p.log", "warn", NULL);
    EPX_WARN(EPX_SUBSYS_CORE, "parent line");
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        EPX_WARN(EPX_SUBSYS_CORE, "child line");
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

    char name[64];
    snprintf(name, sizeof(name), "fork-%ld.log", (long)getpid());
    char *parent_text = read_scratch_file(name);
    snprintf(name, sizeof(name), "fork-%ld.log", (long)child);
    char *child_text = read_scratch_file(name);
    CHECK(strstr(parent_text, "parent line") != NULL);
    CHECK(strstr(parent_text, "child line") == NULL);
    CHECK(strstr(child_text, "child line") != NULL);
    CHECK(strstr(child_text, "parent line") == NULL);
    free(parent_text);
    free(child_text);
}

#define THREADS 4
#define LINES_PER_THREAD 500

static void *log_many_lines(void *argument)
{
    int thread = *(int *)argument;
    for (int i = 0; i < LINES_PER_THREAD; i++)
        EPX_WARN(EPX_SUBSYS_CORE, "thread %d line %d %s end", thread, i,
                 "padding-padding-padding-padding-padding-padding-padding-padding");
    return NULL;
}

static void test_threads_write_whole_lines(void)
{
    configure("threads.log", "warn", NULL);
    pthread_t threads[THREADS];
    int ids[THREADS];
    for (int t = 0; t < THREADS; t++) {
        ids[t] = t;
        CHECK(pthread_create(&threads[t], NULL, log_many_lines, &ids[t]) == 0);
    }
    for (int t = 0; t < THREADS; t++)
        CHECK(pthread_join(threads[t], NULL) == 0);

    char *text = read_scratch_file("threads.log");
    int lines = 0;
    for (char *line = text; *line != '\0'; lines++) {
        char *end = strchr(line, '\n');
        CHECK(end != NULL);
        CHECK(strncmp(line, "epx[", 4) == 0);
        CHECK(end - line > 4 && strncmp(end - 4, " end", 4) == 0);
        line = end + 1;
    }
    CHECK_EQ_INT(lines, THREADS * LINES_PER_THREAD);
    free(text);
}

int main(void)
{
    scratch = make_scratch_dir();
    test_format_and_levels();
    test_rank_in_name_and_line();
    test_subsystem_filter();
    test_parsers_and_paths();
    test_fallback_to_stderr();
    test_fork_reopens_per_pid();
    test_threads_write_whole_lines();
    unset_epx_environment();
    rmdir(scratch);
    printf("test_log: ok\n");
    return 0;
}
