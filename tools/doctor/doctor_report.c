/*
 * `epx doctor` result lines and their printers. The JSON form is one object per line
 * (like `epx bench --json`), so a program can read the checklist while it is still
 * running; every string goes through epx__doctor_json_string, so whatever a driver or
 * a library wrote into a detail, the output stays valid JSON.
 */
#include "doctor_report.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static const char *const status_names[EPX__DOCTOR_STATUS_COUNT] = {
    "pass", "warn", "fail", "not-present", "skip",
};

const char *epx__doctor_status_name(int status)
{
    if (status < 0 || status >= EPX__DOCTOR_STATUS_COUNT)
        return "unknown";
    return status_names[status];
}

int epx__doctor_status_from_name(const char *name)
{
    for (int i = 0; i < EPX__DOCTOR_STATUS_COUNT; i++) {
        if (name != NULL && strcmp(name, status_names[i]) == 0)
            return i;
    }
    return -1;
}

void epx__doctor_report_free(epx__doctor_report_t *report)
{
    free(report->lines);
    report->lines = NULL;
    report->count = 0;
    report->capacity = 0;
}

/* A new zeroed line at the end, or NULL (counted in `lost`) when memory ran out. */
static epx__doctor_line_t *append(epx__doctor_report_t *report)
{
    if (report->count == report->capacity) {
        int capacity = report->capacity > 0 ? 2 * report->capacity : 32;
        epx__doctor_line_t *lines = realloc(report->lines, (size_t)capacity * sizeof(*lines));
        if (lines == NULL) {
            report->lost++;
            return NULL;
        }
        report->lines = lines;
        report->capacity = capacity;
    }
    epx__doctor_line_t *line = &report->lines[report->count++];
    memset(line, 0, sizeof(*line));
    return line;
}

void epx__doctor_add(epx__doctor_report_t *report, const char *name, epx__doctor_status_t status,
                     const char *fix, const char *detail_format, ...)
{
    epx__doctor_line_t *line = append(report);
    if (line == NULL)
        return;
    snprintf(line->name, sizeof(line->name), "%s", name);
    line->status = (int32_t)status;
    snprintf(line->fix, sizeof(line->fix), "%s", fix != NULL ? fix : "");
    va_list args;
    va_start(args, detail_format);
    vsnprintf(line->detail, sizeof(line->detail), detail_format, args);
    va_end(args);
}

void epx__doctor_add_line(epx__doctor_report_t *report, const epx__doctor_line_t *from)
{
    epx__doctor_line_t *line = append(report);
    if (line == NULL)
        return;
    *line = *from;
    /* The record came through a pipe: make sure every string ends inside its array. */
    line->name[sizeof(line->name) - 1] = '\0';
    line->detail[sizeof(line->detail) - 1] = '\0';
    line->fix[sizeof(line->fix) - 1] = '\0';
    if (line->status < 0 || line->status >= EPX__DOCTOR_STATUS_COUNT)
        line->status = EPX__DOCTOR_FAIL;
}

int epx__doctor_count(const epx__doctor_report_t *report, epx__doctor_status_t status)
{
    int count = 0;
    for (int i = 0; i < report->count; i++)
        count += report->lines[i].status == (int32_t)status;
    return count;
}

int epx__doctor_exit_status(const epx__doctor_report_t *report)
{
    /* A line we could not record may have been a failure: do not claim success. */
    return epx__doctor_count(report, EPX__DOCTOR_FAIL) > 0 || report->lost > 0 ? 1 : 0;
}

/* ---------------------------------------------------------------- JSON strings */

/* Length of the valid UTF-8 sequence at `s` (2..4), or 0 when it is not one. */
static int utf8_sequence_length(const unsigned char *s)
{
    int length;
    unsigned int code;
    if (s[0] >= 0xc2 && s[0] <= 0xdf) {
        length = 2;
        code = s[0] & 0x1fu;
    } else if (s[0] >= 0xe0 && s[0] <= 0xef) {
        length = 3;
        code = s[0] & 0x0fu;
    } else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
        length = 4;
        code = s[0] & 0x07u;
    } else {
        return 0;
    }
    for (int i = 1; i < length; i++) {
        if ((s[i] & 0xc0) != 0x80) /* also stops at the terminating NUL */
            return 0;
        code = (code << 6) | (s[i] & 0x3fu);
    }
    /* Reject overlong forms, UTF-16 surrogates and values past U+10FFFF. */
    if ((length == 3 && code < 0x800) || (length == 4 && code < 0x10000) || code > 0x10ffff ||
        (code >= 0xd800 && code <= 0xdfff))
        return 0;
    return length;
}

size_t epx__doctor_json_string(const char *text, char *out, size_t out_size)
{
    if (out_size == 0)
        return 0;
    size_t used = 0;
    /* Keep room for the closing quote and the NUL. */
    size_t limit = out_size >= 2 ? out_size - 2 : 0;
    if (limit > 0)
        out[used++] = '"';
    const unsigned char *s = (const unsigned char *)(text != NULL ? text : "");
    while (*s != '\0') {
        char piece[8];
        size_t piece_length;
        int sequence = *s >= 0x80 ? utf8_sequence_length(s) : 0;
        if (sequence > 0) {
            memcpy(piece, s, (size_t)sequence);
            piece_length = (size_t)sequence;
        } else if (*s == '"' || *s == '\\') {
            piece[0] = '\\';
            piece[1] = (char)*s;
            piece_length = 2;
        } else if (*s == '\n' || *s == '\t' || *s == '\r') {
            piece[0] = '\\';
            piece[1] = *s == '\n' ? 'n' : *s == '\t' ? 't' : 'r';
            piece_length = 2;
        } else if (*s < 0x20 || *s >= 0x7f) {
            piece_length = (size_t)snprintf(piece, sizeof(piece), "\\u%04x", (unsigned int)*s);
        } else {
            piece[0] = (char)*s;
            piece_length = 1;
        }
        if (used + piece_length > limit)
            break; /* truncate between pieces, never inside an escape */
        memcpy(out + used, piece, piece_length);
        used += piece_length;
        s += sequence > 0 ? (size_t)sequence : 1;
    }
    if (out_size >= 2)
        out[used++] = '"';
    out[used] = '\0';
    return used;
}

static void print_json_field(FILE *out, const char *key, const char *value)
{
    /* Escaping can grow a string to 6 bytes per input byte. */
    static char buffer[6 * EPX__DOCTOR_DETAIL_MAX + 4];
    epx__doctor_json_string(value, buffer, sizeof(buffer));
    fprintf(out, "\"%s\":%s", key, buffer);
}

/* ---------------------------------------------------------------- printers */

void epx__doctor_print_json_start(FILE *out)
{
    fputs("{\"checks\":[\n", out);
    fflush(out);
}

void epx__doctor_print_json(FILE *out, const epx__doctor_report_t *report, int first)
{
    for (int i = first < 0 ? 0 : first; i < report->count; i++) {
        const epx__doctor_line_t *line = &report->lines[i];
        fputs(i > 0 ? ",\n{" : "{", out);
        print_json_field(out, "check", line->name);
        fputc(',', out);
        print_json_field(out, "status", epx__doctor_status_name(line->status));
        fputc(',', out);
        print_json_field(out, "detail", line->detail);
        fputc(',', out);
        print_json_field(out, "fix", line->fix);
        fputc('}', out);
    }
    fflush(out);
}

/* Print `text` with every line after the first indented by `indent` spaces. */
static void print_indented(FILE *out, const char *text, int indent)
{
    for (const char *p = text; *p != '\0'; p++) {
        fputc(*p, out);
        if (*p == '\n' && p[1] != '\0')
            fprintf(out, "%*s", indent, "");
    }
}

void epx__doctor_print_text(FILE *out, const epx__doctor_report_t *report, int first)
{
    /* "[not-present] " is the widest tag; the detail column starts after the name. */
    const int indent = 14 + 27;
    for (int i = first < 0 ? 0 : first; i < report->count; i++) {
        const epx__doctor_line_t *line = &report->lines[i];
        char tag[24];
        snprintf(tag, sizeof(tag), "[%s]", epx__doctor_status_name(line->status));
        fprintf(out, "%-13s %-26s ", tag, line->name);
        print_indented(out, line->detail, indent);
        fputc('\n', out);
        if (line->fix[0] != '\0') {
            fprintf(out, "%*sfix: ", indent, "");
            print_indented(out, line->fix, indent + 5);
            fputc('\n', out);
        }
    }
    fflush(out);
}

void epx__doctor_print_summary_text(FILE *out, const epx__doctor_report_t *report)
{
    fprintf(out, "\nsummary: %d pass, %d warn, %d fail, %d not present, %d skipped",
            epx__doctor_count(report, EPX__DOCTOR_PASS), epx__doctor_count(report, EPX__DOCTOR_WARN),
            epx__doctor_count(report, EPX__DOCTOR_FAIL),
            epx__doctor_count(report, EPX__DOCTOR_NOT_PRESENT),
            epx__doctor_count(report, EPX__DOCTOR_SKIP));
    if (report->lost > 0)
        fprintf(out, ", %d lines lost (out of memory)", report->lost);
    if (epx__doctor_exit_status(report) == 0)
        fprintf(out, "\nnothing failed: epx can run here%s\n",
                epx__doctor_count(report, EPX__DOCTOR_WARN) > 0
                    ? " (the warnings say what keeps it from full speed)"
                    : "");
    else
        fprintf(out, "\nsome checks failed: fix them first (each says how)\n");
    fflush(out);
}

void epx__doctor_print_summary_json(FILE *out, const epx__doctor_report_t *report)
{
    fprintf(out,
            "%s],\n\"summary\":{\"pass\":%d,\"warn\":%d,\"fail\":%d,\"not-present\":%d,"
            "\"skip\":%d,\"lost\":%d,\"exit_status\":%d}}\n",
            report->count > 0 ? "\n" : "",
            epx__doctor_count(report, EPX__DOCTOR_PASS), epx__doctor_count(report, EPX__DOCTOR_WARN),
            epx__doctor_count(report, EPX__DOCTOR_FAIL),
            epx__doctor_count(report, EPX__DOCTOR_NOT_PRESENT),
            epx__doctor_count(report, EPX__DOCTOR_SKIP), report->lost,
            epx__doctor_exit_status(report));
    fflush(out);
}
