/*
 * `epx doctor` runs every risky check in a child process: a check that finishes sends
 * its lines and facts back; one that crashes or hangs becomes a FAIL line naming what
 * happened (and what it printed last), and the doctor goes on. Also the program runner
 * used for nvidia-cuda-mps-control, python3 and the smoke run.
 *
 * Built with tools/doctor/doctor_child.c and tools/doctor/doctor_report.c (tests/doctor.cmake).
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "doctor_child.h"
#include "doctor_report.h"
#include "test_util.h"

typedef struct {
    int answer;
    char word[16];
} facts_t;

static void finishes(epx__doctor_report_t *report, void *arg, void *facts)
{
    facts_t *out = facts;
    out->answer = *(int *)arg;
    snprintf(out->word, sizeof(out->word), "hello");
    printf("this goes to the capture file, not to the doctor's stdout\n");
    epx__doctor_add(report, "test.one", EPX__DOCTOR_PASS, NULL, "first");
    epx__doctor_add(report, "test.two", EPX__DOCTOR_WARN, "do this", "second %d", 2);
}

static void crashes(epx__doctor_report_t *report, void *arg, void *facts)
{
    (void)report;
    (void)arg;
    (void)facts;
    fprintf(stderr, "about to crash\n");
    /* SIGKILL, not SIGSEGV: a sanitizer build catches SEGV and exits with a status. */
    raise(SIGKILL);
}

static void hangs(epx__doctor_report_t *report, void *arg, void *facts)
{
    (void)report;
    (void)arg;
    (void)facts;
    printf("waiting forever\n");
    fflush(stdout);
    /* A grandchild in the same process group must be stopped too. */
    if (fork() == 0)
        for (;;)
            pause();
    for (;;)
        pause();
}

static void reads_own_output(epx__doctor_report_t *report, void *arg, void *facts)
{
    (void)arg;
    (void)facts;
    printf("first line\nWARN: the last thing a library said\n\n");
    char tail[128];
    epx__doctor_child_output_tail(tail, sizeof(tail));
    epx__doctor_add(report, "test.tail", EPX__DOCTOR_PASS, NULL, "%s", tail);
}

static void test_children(void)
{
    epx__doctor_report_t report = EPX__DOCTOR_REPORT_INIT;
    facts_t facts;
    int value = 42;
    CHECK_EQ_INT(epx__doctor_run_child(&report, "test.one", 10.0, finishes, &value, &facts,
                                       sizeof(facts)),
                 EPX__DOCTOR_CHILD_DONE);
    CHECK_EQ_INT(report.count, 2);
    CHECK_EQ_INT(facts.answer, 42);
    CHECK(strcmp(facts.word, "hello") == 0);
    CHECK(strcmp(report.lines[1].name, "test.two") == 0);
    CHECK(strcmp(report.lines[1].detail, "second 2") == 0);
    CHECK(strcmp(report.lines[1].fix, "do this") == 0);
    CHECK_EQ_INT(report.lines[1].status, EPX__DOCTOR_WARN);

    CHECK_EQ_INT(epx__doctor_run_child(&report, "test.crash", 10.0, crashes, NULL, NULL, 0),
                 EPX__DOCTOR_CHILD_CRASHED);
    CHECK_EQ_INT(report.count, 3);
    CHECK(strcmp(report.lines[2].name, "test.crash") == 0);
    CHECK_EQ_INT(report.lines[2].status, EPX__DOCTOR_FAIL);
    CHECK(strstr(report.lines[2].detail, "crashed (signal 9") != NULL);
    CHECK(strstr(report.lines[2].detail, "about to crash") != NULL);
    CHECK(report.lines[2].fix[0] != '\0');

    int64_t start = epx__now_ns();
    CHECK_EQ_INT(epx__doctor_run_child(&report, "test.hang", 1.0, hangs, NULL, NULL, 0),
                 EPX__DOCTOR_CHILD_TIMED_OUT);
    CHECK(epx__now_ns() - start < 5000000000LL);
    CHECK_EQ_INT(report.count, 4);
    CHECK(strstr(report.lines[3].detail, "did not finish within 1 s") != NULL);
    CHECK(strstr(report.lines[3].detail, "waiting forever") != NULL);

    CHECK_EQ_INT(epx__doctor_run_child(&report, "test.tail", 10.0, reads_own_output, NULL, NULL, 0),
                 EPX__DOCTOR_CHILD_DONE);
    CHECK(strcmp(report.lines[4].detail, "WARN: the last thing a library said") == 0);
    CHECK_EQ_INT(epx__doctor_exit_status(&report), 1);
    epx__doctor_report_free(&report);
}

static void test_programs(void)
{
    char out[64], err[64];
    int timed_out = -1;
    char *const echo[] = {"sh", "-c", "cat; echo to-stderr >&2; exit 3", NULL};
    CHECK_EQ_INT(epx__doctor_run_program(echo, "from stdin\n", out, sizeof(out), err,
                                         sizeof(err), 10.0, &timed_out),
                 3);
    CHECK_EQ_INT(timed_out, 0);
    CHECK(strcmp(out, "from stdin\n") == 0);
    CHECK(strcmp(err, "to-stderr\n") == 0);

    /* Output beyond the buffer is read (so the program never blocks) and dropped. */
    char *const big[] = {"sh", "-c", "yes | head -c 200000", NULL};
    CHECK_EQ_INT(epx__doctor_run_program(big, NULL, out, sizeof(out), NULL, 0, 10.0, NULL), 0);
    CHECK_EQ_INT(strlen(out), sizeof(out) - 1);

    int64_t start = epx__now_ns();
    char *const slow[] = {"sh", "-c", "sleep 30 & sleep 30", NULL};
    CHECK_EQ_INT(epx__doctor_run_program(slow, NULL, NULL, 0, NULL, 0, 1.0, &timed_out), -1);
    CHECK_EQ_INT(timed_out, 1);
    CHECK(epx__now_ns() - start < 5000000000LL);

    char *const missing[] = {"epx-no-such-program", NULL};
    CHECK_EQ_INT(epx__doctor_run_program(missing, NULL, NULL, 0, err, sizeof(err), 10.0, NULL), 127);
    CHECK(strstr(err, "cannot run epx-no-such-program") != NULL);

    char path[4096];
    CHECK(epx__doctor_find_in_path("sh", path, sizeof(path)));
    CHECK(strstr(path, "/sh") != NULL);
    CHECK(!epx__doctor_find_in_path("epx-no-such-program", path, sizeof(path)));
}

int main(void)
{
    test_children();
    test_programs();
    printf("test_doctor_child: all passed\n");
    return 0;
}
