/*
 * `epx doctor`'s result lines: status names, the exit status rule (only a failure
 * fails), JSON strings that stay valid whatever a driver or library wrote into a
 * detail, and the two printers.
 *
 * Built with tools/doctor/doctor_report.c (tests/doctor.cmake).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "doctor_report.h"
#include "test_util.h"

static void test_status_names(void)
{
    static const char *const names[] = {"pass", "warn", "fail", "not-present", "skip"};
    for (int i = 0; i < EPX__DOCTOR_STATUS_COUNT; i++) {
        CHECK_STR(epx__doctor_status_name(i), names[i]);
        CHECK_EQ_INT(epx__doctor_status_from_name(names[i]), i);
    }
    CHECK_STR(epx__doctor_status_name(-1), "unknown");
    CHECK_STR(epx__doctor_status_name(EPX__DOCTOR_STATUS_COUNT), "unknown");
    CHECK_EQ_INT(epx__doctor_status_from_name("PASS"), -1);
    CHECK_EQ_INT(epx__doctor_status_from_name(NULL), -1);
}

static void test_json_strings(void)
{
    char out[256];
    epx__doctor_json_string("plain", out, sizeof(out));
    CHECK_STR(out, "\"plain\"");
    epx__doctor_json_string("a \"quote\" and \\ back\nslash\ttab\r", out, sizeof(out));
    CHECK_STR(out, "\"a \\\"quote\\\" and \\\\ back\\nslash\\ttab\\r\"");
    epx__doctor_json_string("bell\a esc\x1b del\x7f", out, sizeof(out));
    CHECK_STR(out, "\"bell\\u0007 esc\\u001b del\\u007f\"");
    /* Valid UTF-8 passes through; a stray byte or an overlong form is escaped. */
    epx__doctor_json_string("caf\xc3\xa9 \xe2\x86\x92 \xf0\x9f\x9a\x80", out, sizeof(out));
    CHECK_STR(out, "\"caf\xc3\xa9 \xe2\x86\x92 \xf0\x9f\x9a\x80\"");
    epx__doctor_json_string("bad \xff \xc3 end \xc0\xaf", out, sizeof(out));
    CHECK_STR(out, "\"bad \\u00ff \\u00c3 end \\u00c0\\u00af\"");
    epx__doctor_json_string(NULL, out, sizeof(out));
    CHECK_STR(out, "\"\"");
    /* Truncation keeps the quotes and never splits an escape. */
    char small[8];
    size_t length = epx__doctor_json_string("ab\"cdef", small, sizeof(small));
    CHECK_STR(small, "\"ab\\\"c\"");
    CHECK_EQ_INT(length, strlen(small));
    length = epx__doctor_json_string("abcd\n", small, 7);
    CHECK_STR(small, "\"abcd\"");
    CHECK_EQ_INT(length, 6);
}

static char *read_all(FILE *file)
{
    static char buffer[65536];
    rewind(file);
    size_t got = fread(buffer, 1, sizeof(buffer) - 1, file);
    buffer[got] = '\0';
    return buffer;
}

static void test_report_and_printers(void)
{
    epx__doctor_report_t report = EPX__DOCTOR_REPORT_INIT;
    CHECK_EQ_INT(epx__doctor_exit_status(&report), 0);
    epx__doctor_add(&report, "gpu.driver", EPX__DOCTOR_NOT_PRESENT, NULL, "no driver: %s",
                    "libcuda.so.1 missing");
    epx__doctor_add(&report, "gpu.mps", EPX__DOCTOR_WARN, "start \"MPS\"", "%d ranks", 8);
    epx__doctor_add(&report, "smoke.run", EPX__DOCTOR_SKIP, NULL, "skipped");
    CHECK_EQ_INT(epx__doctor_exit_status(&report), 0); /* warnings and absences pass */
    epx__doctor_add(&report, "gpu.ipc", EPX__DOCTOR_FAIL, "fix it", "line one\nline two");
    CHECK_EQ_INT(epx__doctor_exit_status(&report), 1);
    CHECK_EQ_INT(report.count, 4);
    CHECK_EQ_INT(epx__doctor_count(&report, EPX__DOCTOR_WARN), 1);
    CHECK_EQ_INT(epx__doctor_count(&report, EPX__DOCTOR_PASS), 0);

    /* A line from a child process with a bad status and no terminators is repaired. */
    epx__doctor_line_t line;
    memset(&line, 'x', sizeof(line));
    line.status = 77;
    epx__doctor_add_line(&report, &line);
    CHECK_EQ_INT(report.lines[4].status, EPX__DOCTOR_FAIL);
    CHECK_EQ_INT(strlen(report.lines[4].name), EPX__DOCTOR_NAME_MAX - 1);
    CHECK_EQ_INT(strlen(report.lines[4].fix), EPX__DOCTOR_FIX_MAX - 1);

    /* A detail longer than the line holds is cut, not refused. */
    char long_detail[4 * EPX__DOCTOR_DETAIL_MAX];
    memset(long_detail, 'd', sizeof(long_detail) - 1);
    long_detail[sizeof(long_detail) - 1] = '\0';
    epx__doctor_add(&report, "env.epx", EPX__DOCTOR_PASS, NULL, "%s", long_detail);
    CHECK_EQ_INT(strlen(report.lines[5].detail), EPX__DOCTOR_DETAIL_MAX - 1);

    /* JSON: one document, printed in two parts as the checks finish, then the summary. */
    FILE *file = tmpfile();
    CHECK(file != NULL);
    epx__doctor_print_json_start(file);
    epx__doctor_print_json(file, &report, 0);
    epx__doctor_add(&report, "smoke.run", EPX__DOCTOR_PASS, NULL, "late");
    epx__doctor_print_json(file, &report, 6);
    epx__doctor_print_summary_json(file, &report);
    char *text = read_all(file);
    CHECK(strncmp(text,
                  "{\"checks\":[\n"
                  "{\"check\":\"gpu.driver\",\"status\":\"not-present\",\"detail\":\"no driver: "
                  "libcuda.so.1 missing\",\"fix\":\"\"},\n"
                  "{\"check\":\"gpu.mps\",\"status\":\"warn\",\"detail\":\"8 ranks\",\"fix\":"
                  "\"start \\\"MPS\\\"\"},\n",
                  strlen("{\"checks\":[\n{\"check\":\"gpu.driver\"")) == 0);
    CHECK(strstr(text, "{\"check\":\"gpu.mps\",\"status\":\"warn\",\"detail\":\"8 ranks\","
                       "\"fix\":\"start \\\"MPS\\\"\"},\n") != NULL);
    CHECK(strstr(text, "\"detail\":\"line one\\nline two\",\"fix\":\"fix it\"},\n") != NULL);
    /* The check added after the first part follows with a comma; no comma before "]". */
    CHECK(strstr(text, "},\n{\"check\":\"smoke.run\",\"status\":\"pass\",\"detail\":\"late\","
                       "\"fix\":\"\"}\n],\n\"summary\":{\"pass\":2,\"warn\":1,\"fail\":2,"
                       "\"not-present\":1,\"skip\":1,\"lost\":0,\"exit_status\":1}}\n") != NULL);
    int objects = 0;
    for (const char *p = text; (p = strstr(p, "{\"check\":")) != NULL; p++)
        objects++;
    CHECK_EQ_INT(objects, report.count);
    CHECK_EQ_INT(text[strlen(text) - 1], '\n');
    fclose(file);

    /* No checks at all: still one valid document. */
    epx__doctor_report_t empty = EPX__DOCTOR_REPORT_INIT;
    file = tmpfile();
    CHECK(file != NULL);
    epx__doctor_print_json_start(file);
    epx__doctor_print_json(file, &empty, 0);
    epx__doctor_print_summary_json(file, &empty);
    CHECK(strcmp(read_all(file), "{\"checks\":[\n],\n\"summary\":{\"pass\":0,\"warn\":0,"
                                 "\"fail\":0,\"not-present\":0,\"skip\":0,\"lost\":0,"
                                 "\"exit_status\":0}}\n") == 0);
    fclose(file);

    file = tmpfile();
    CHECK(file != NULL);
    epx__doctor_print_text(file, &report, 0);
    epx__doctor_print_summary_text(file, &report);
    text = read_all(file);
    CHECK(strstr(text, "[not-present] gpu.driver") != NULL);
    CHECK(strstr(text, "[warn]        gpu.mps") != NULL);
    CHECK(strstr(text, "fix: start \"MPS\"\n") != NULL);
    /* The second line of a detail is indented under the first. */
    CHECK(strstr(text, "line one\n                                         line two\n") != NULL);
    CHECK(strstr(text, "summary: 2 pass, 1 warn, 2 fail, 1 not present, 1 skipped") != NULL);
    CHECK(strstr(text, "some checks failed") != NULL);
    fclose(file);
    epx__doctor_report_free(&report);
    CHECK_EQ_INT(report.count, 0);
}

int main(void)
{
    test_status_names();
    test_json_strings();
    test_report_and_printers();
    printf("test_doctor_report: all passed\n");
    return 0;
}
