/*
 * Bench output. The metrics are the ones DeepEP prints, so numbers compare across
 * projects: bytes a rank receives (dispatch) or sends (combine) divided by the op's time
 * is the "bottleneck bandwidth". The floor is the time all ranks together need to move
 * the bytes the op must read and write once at the copy bandwidth (on one GPU every rank
 * shares the same memory): a dispatch reads each source token once and writes each
 * received row once; a combine reads each received row once and writes each output row
 * once.
 */
#include "bench_report.h"

#include <math.h>
#include <stdlib.h>

const char *epx__bench_op_name(epx__bench_op_t op)
{
    switch (op) {
    case EPX__BENCH_OP_LAYOUT:
        return "layout";
    case EPX__BENCH_OP_DISPATCH:
        return "dispatch";
    case EPX__BENCH_OP_CACHED_DISPATCH:
        return "cached_dispatch";
    case EPX__BENCH_OP_COMBINE:
        return "combine";
    case EPX__BENCH_OP_COMBINE_COPY:
        return "combine_copy";
    case EPX__BENCH_OP_COMBINE_REGISTERED:
        return "combine_registered";
    case EPX__BENCH_OP_COMBINE_WEIGHTS:
        return "combine_weights";
    default:
        return "unknown";
    }
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double epx__bench_median(double *values, int count)
{
    if (count <= 0)
        return NAN;
    qsort(values, (size_t)count, sizeof(double), compare_doubles);
    if (count % 2 == 1)
        return values[count / 2];
    return (values[count / 2 - 1] + values[count / 2]) / 2;
}

double epx__bench_p99(double *values, int count)
{
    if (count <= 0)
        return NAN;
    qsort(values, (size_t)count, sizeof(double), compare_doubles);
    int rank = (int)ceil(0.99 * count); /* nearest rank: the smallest value >= 99% */
    if (rank < 1)
        rank = 1;
    return values[rank - 1];
}

double epx__bench_mean(const double *values, int count)
{
    if (count <= 0)
        return NAN;
    double sum = 0;
    for (int i = 0; i < count; i++)
        sum += values[i];
    return sum / count;
}

double epx__bench_copy_time_us(int64_t bytes, double bw_gbps)
{
    if (bytes <= 0 || !(bw_gbps > 0))
        return NAN;
    return (double)bytes / bw_gbps / 1e3; /* bytes / (GB/s) = ns */
}

int64_t epx__bench_dispatch_floor_bytes(int64_t tokens, int64_t source_row, int64_t received,
                                        int64_t dispatch_row)
{
    return tokens * source_row + received * dispatch_row;
}

int64_t epx__bench_combine_floor_bytes(int64_t tokens, int64_t combine_token, int64_t received,
                                       int64_t combine_row)
{
    return received * combine_row + tokens * (combine_row + combine_token);
}

double epx__bench_floor_us(const epx__bench_context_t *context, const epx__bench_row_t *row)
{
    return epx__bench_copy_time_us(row->floor_bytes, context->floor_bw_gbps);
}

double epx__bench_floor_over_time(double floor_us, double time_us)
{
    if (!isfinite(floor_us) || !(time_us > 0))
        return NAN;
    return floor_us / time_us;
}

double epx__bench_gbps(int64_t bytes_per_rank, double median_us)
{
    if (bytes_per_rank <= 0 || !(median_us > 0))
        return NAN;
    return (double)bytes_per_rank / (median_us * 1e3);
}

const char *epx__bench_check_text(int check)
{
    if (check == EPX__BENCH_CHECK_PASS)
        return "PASS";
    if (check == EPX__BENCH_CHECK_FAIL)
        return "FAIL";
    return "-";
}

const char *epx__bench_dtype_text(epx_dtype_t dtype)
{
    return dtype == EPX_DTYPE_FP8_E4M3 ? "fp8" : "bf16";
}

void epx__bench_print_json_check_end(FILE *out, int check)
{
    if (check == EPX__BENCH_CHECK_NONE)
        fprintf(out, ",\"check\":null}\n");
    else
        fprintf(out, ",\"check\":\"%s\"}\n", epx__bench_check_text(check));
}

void epx__bench_format_bytes(int64_t bytes, char *text, size_t size)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) {
        snprintf(text, size, "%lld B", (long long)bytes);
        return;
    }
    double value = (double)bytes / 1024.0;
    int unit = 0;
    while (value >= 1024.0 && unit < 3) {
        value /= 1024.0;
        unit++;
    }
    snprintf(text, size, "%.2f %s", value, units[unit]);
}

void epx__bench_print_sms(FILE *out, const epx__bench_context_t *context)
{
    if (context->sms > 0)
        fprintf(out, ", SMs %d", context->sms);
}

void epx__bench_print_floor_header(FILE *out, const epx__bench_context_t *context,
                                   const char *what)
{
    if (context->floor_bw_gbps > 0)
        fprintf(out, "# floor: the bytes all ranks must read and write, at %.1f GB/s (%s):\n",
                context->floor_bw_gbps, context->floor_source);
    else
        fprintf(out, "# floor: unknown (%s); it would count:\n", context->floor_source);
    fprintf(out, "#   %s\n", what);
    fprintf(out, "# floor/time = floor_us / the slowest rank's median (1.00 = at the floor, "
                 "0.50 = twice its time)\n");
}

void epx__bench_print_header(FILE *out, const epx__bench_context_t *context)
{
    fprintf(out,
            "# epx bench: backend %s, %d ranks, tokens %lld hidden %lld experts %d topk %d "
            "alignment %d seed %llu",
            context->backend, context->ranks, (long long)context->tokens,
            (long long)context->hidden, context->experts, context->topk, context->alignment,
            (unsigned long long)context->seed);
    epx__bench_print_sms(out, context);
    fprintf(out, ", warmup %d iters %d\n", context->warmup, context->iters);
    if (context->auto_register)
        fprintf(out, "# --auto-register: combine_copy's x is mapped for the peers on demand "
                     "(config.auto_register 1) and read in place, not copied in\n");
    epx__bench_print_floor_header(
        out, context,
        "dispatch: each source token once (x, scales, top-k ids and weights) + each received "
        "row once (the same);\n#   cached dispatch: x and scales only; combine: each received "
        "row once + each output row once (combine_weights: each with its top-k weights)");
    fprintf(out, "# median and p99: rank 0's times in us; GB/s = rank 0's bytes / its median;\n"
                 "# slowest: median over iterations of the slowest rank\n");
    fprintf(out, "# %-5s %-16s %11s %11s %11s %10s %11s %10s %5s\n", "dtype", "op", "median_us",
            "p99_us", "slowest_us", "GB/s/rank", "floor_us", "floor/time", "check");
    fflush(out);
}

void epx__bench_print_number(FILE *out, int width, int precision, double value,
                             const char *missing)
{
    if (isfinite(value))
        fprintf(out, "%*.*f", width, precision, value);
    else
        fprintf(out, "%*s", width, missing);
}

static void print_table_row(FILE *out, const epx__bench_context_t *context,
                            const epx__bench_row_t *row)
{
    double floor_us = epx__bench_floor_us(context, row);
    fprintf(out, "  %-5s %-16s ", epx__bench_dtype_text(row->dtype), epx__bench_op_name(row->op));
    epx__bench_print_number(out, 11, 1, row->median_us, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 11, 1, row->p99_us, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 11, 1, row->slowest_us, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 10, 2, epx__bench_gbps(row->bytes_per_rank, row->median_us), "-");
    fputc(' ', out);
    epx__bench_print_number(out, 11, 1, floor_us, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 10, 2, epx__bench_floor_over_time(floor_us, row->slowest_us), "-");
    fprintf(out, " %5s\n", epx__bench_check_text(row->check));
}

void epx__bench_print_json_number(FILE *out, const char *key, double value)
{
    if (isfinite(value))
        fprintf(out, ",\"%s\":%.6g", key, value);
    else
        fprintf(out, ",\"%s\":null", key);
}

void epx__bench_print_json_traffic(FILE *out, const epx__bench_context_t *context,
                                   int64_t bytes_per_rank, int64_t total_bytes,
                                   int64_t floor_bytes, double median_us, double slowest_us)
{
    double floor_us = epx__bench_copy_time_us(floor_bytes, context->floor_bw_gbps);
    fprintf(out, ",\"bytes_per_rank\":%lld,\"total_bytes\":%lld,\"floor_bytes\":%lld",
            (long long)bytes_per_rank, (long long)total_bytes, (long long)floor_bytes);
    epx__bench_print_json_number(out, "gbps_per_rank", epx__bench_gbps(bytes_per_rank, median_us));
    epx__bench_print_json_number(out, "floor_bw_gbps",
                                 context->floor_bw_gbps > 0 ? context->floor_bw_gbps : NAN);
    fprintf(out, ",\"floor_source\":\"%s\"", context->floor_source);
    epx__bench_print_json_number(out, "floor_us", floor_us);
    epx__bench_print_json_number(out, "floor_over_time",
                                 epx__bench_floor_over_time(floor_us, slowest_us));
}

/* Strings printed here are our own fixed words (no quotes or backslashes to escape). */
static void print_json_row(FILE *out, const epx__bench_context_t *context,
                           const epx__bench_row_t *row)
{
    fprintf(out, "{\"mode\":\"normal\",\"backend\":\"%s\",\"ranks\":%d,\"tokens\":%lld,"
                 "\"hidden\":%lld,\"experts\":%d,\"topk\":%d,\"alignment\":%d,\"seed\":%llu,"
                 "\"warmup\":%d,\"iters\":%d,\"dtype\":\"%s\",\"op\":\"%s\"",
            context->backend, context->ranks, (long long)context->tokens,
            (long long)context->hidden, context->experts, context->topk, context->alignment,
            (unsigned long long)context->seed, context->warmup, context->iters,
            epx__bench_dtype_text(row->dtype), epx__bench_op_name(row->op));
    epx__bench_print_json_number(out, "sms", context->sms > 0 ? context->sms : NAN);
    fprintf(out, ",\"auto_register\":%d", context->auto_register ? 1 : 0);
    epx__bench_print_json_number(out, "median_us", row->median_us);
    epx__bench_print_json_number(out, "p99_us", row->p99_us);
    epx__bench_print_json_number(out, "slowest_median_us", row->slowest_us);
    epx__bench_print_json_traffic(out, context, row->bytes_per_rank, row->total_bytes,
                                  row->floor_bytes, row->median_us, row->slowest_us);
    if (row->back_to_back_us > 0) {
        epx__bench_print_json_number(out, "back_to_back_us", row->back_to_back_us);
        epx__bench_print_json_number(
            out, "back_to_back_floor_over_time",
            epx__bench_floor_over_time(epx__bench_floor_us(context, row), row->back_to_back_us));
    }
    epx__bench_print_json_check_end(out, row->check);
}

void epx__bench_print_back_to_back(FILE *out, const epx__bench_context_t *context,
                                   const epx__bench_row_t *rows, int count)
{
    int any = 0;
    for (int i = 0; i < count; i++) {
        const epx__bench_row_t *row = &rows[i];
        if (row->back_to_back_us <= 0)
            continue;
        if (!any)
            fprintf(out, "# back to back (%d calls of each between one pair of events, no "
                         "event between the calls; dispatch: fresh, without a host wait, "
                         "EPX_DISPATCH_WORST_CASE): the slowest rank's time a call\n",
                    context->back_to_back);
        any = 1;
        double floor_us = epx__bench_floor_us(context, row);
        fprintf(out, "#   %-5s %-18s %10.1f us  floor/time ", epx__bench_dtype_text(row->dtype),
                epx__bench_op_name(row->op), row->back_to_back_us);
        epx__bench_print_number(
            out, 4, 2, epx__bench_floor_over_time(floor_us, row->back_to_back_us), "-");
        fputc('\n', out);
    }
    fflush(out);
}

void epx__bench_print_row(FILE *out, const epx__bench_context_t *context,
                          const epx__bench_row_t *row, int json)
{
    if (json)
        print_json_row(out, context, row);
    else
        print_table_row(out, context, row);
    fflush(out);
}
