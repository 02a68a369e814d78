/*
 * `epx doctor` results: one line per check (name, status, detail, fix) and the two ways
 * of printing them, a text checklist for people and one JSON document for programs. Lines are fixed-size records so that a check run in a child process can
 * send them back through a pipe unchanged.
 */
#ifndef EPX_TOOLS_DOCTOR_REPORT_H
#define EPX_TOOLS_DOCTOR_REPORT_H

#include <stdint.h>
#include <stdio.h>

typedef enum {
    EPX__DOCTOR_PASS = 0,        /* works as needed */
    EPX__DOCTOR_WARN = 1,        /* works, but not at full speed or not as deployed */
    EPX__DOCTOR_FAIL = 2,        /* epx will not work until this is fixed */
    EPX__DOCTOR_NOT_PRESENT = 3, /* the hardware or software is not on this machine */
    EPX__DOCTOR_SKIP = 4,        /* not checked (says why) */
    EPX__DOCTOR_STATUS_COUNT = 5,
} epx__doctor_status_t;

#define EPX__DOCTOR_NAME_MAX 48
#define EPX__DOCTOR_DETAIL_MAX 1536
#define EPX__DOCTOR_FIX_MAX 512

typedef struct {
    char name[EPX__DOCTOR_NAME_MAX]; /* "group.check", e.g. "gpu.ipc" */
    int32_t status;                  /* epx__doctor_status_t */
    char detail[EPX__DOCTOR_DETAIL_MAX]; /* what was found; may hold several lines */
    char fix[EPX__DOCTOR_FIX_MAX];       /* one sentence, "" when there is nothing to do */
} epx__doctor_line_t;

typedef struct {
    epx__doctor_line_t *lines;
    int count;
    int capacity;
    int lost; /* lines dropped because memory ran out (reported by the printers) */
} epx__doctor_report_t;

#define EPX__DOCTOR_REPORT_INIT {NULL, 0, 0, 0}

void epx__doctor_report_free(epx__doctor_report_t *report);

/* "pass", "warn", "fail", "not-present", "skip"; "unknown" outside the list. */
const char *epx__doctor_status_name(int status);
/* The status for a name above; -1 when the name is not one of them. */
int epx__doctor_status_from_name(const char *name);

/*
 * Append a line. `fix` may be NULL (nothing to do); the detail is printf-formatted and
 * cut to fit. Long texts are truncated, never rejected: a doctor must always report.
 */
void epx__doctor_add(epx__doctor_report_t *report, const char *name, epx__doctor_status_t status,
                     const char *fix, const char *detail_format, ...)
    __attribute__((format(printf, 5, 6)));
/* Append a copy of a line received from a child process (status clamped to the list). */
void epx__doctor_add_line(epx__doctor_report_t *report, const epx__doctor_line_t *line);

int epx__doctor_count(const epx__doctor_report_t *report, epx__doctor_status_t status);
/* 0 when no line failed, else 1 (the exit status of `epx doctor`). */
int epx__doctor_exit_status(const epx__doctor_report_t *report);

/*
 * Lines [first, report->count) as a checklist / as JSON. The JSON output is one document,
 * printed as the checks finish (one check per line):
 *   {"checks": [
 *   {"check": NAME, "status": STATUS, "detail": TEXT, "fix": TEXT},
 *   ...
 *   ],
 *   "summary": {"pass": N, "warn": N, "fail": N, "not-present": N, "skip": N, "lost": N,
 *               "exit_status": 0 or 1}}
 * print_json_start opens it, print_json adds checks (a comma before every check but the
 * document's first), print_summary_json closes it.
 */
void epx__doctor_print_text(FILE *out, const epx__doctor_report_t *report, int first);
void epx__doctor_print_json_start(FILE *out);
void epx__doctor_print_json(FILE *out, const epx__doctor_report_t *report, int first);
/* The closing summary: counts per status and the exit status. */
void epx__doctor_print_summary_text(FILE *out, const epx__doctor_report_t *report);
void epx__doctor_print_summary_json(FILE *out, const epx__doctor_report_t *report);

/*
 * `text` as a JSON string literal with its quotes: ", \ and control characters escaped
 * (\n, \t, \uXXXX), bytes >= 0x80 passed through (UTF-8 stays UTF-8; an invalid
 * byte becomes \u00XX so the output is always valid JSON). Writes at most out_size bytes
 * including the terminating NUL, never cutting an escape in half; returns the length
 * written.
 */
size_t epx__doctor_json_string(const char *text, char *out, size_t out_size);

#endif /* EPX_TOOLS_DOCTOR_REPORT_H */
