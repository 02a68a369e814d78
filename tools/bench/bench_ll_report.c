/*
 * What `epx bench --mode ll` prints: latency in microseconds as DeepEP reports it for
 * its low-latency kernels, per op the median, p99 and mean of rank 0 and of the slowest
 * rank, the bytes each rank sends, the buffer memory, and the floor with the same
 * floor/time ratio as normal mode (bench_report.h); as a table with a header or as one
 * JSON object per line. The CUDA-graph row exists on the GPU backend only.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_ll.h"

const char *epx__bench_ll_op_name(epx__bench_ll_op_t op)
{
    switch (op) {
    case EPX__BENCH_LL_DISPATCH:
        return "dispatch";
    case EPX__BENCH_LL_COMBINE:
        return "combine";
    case EPX__BENCH_LL_DISPATCH_SEND:
        return "dispatch_send";
    case EPX__BENCH_LL_DISPATCH_RECV:
        return "dispatch_recv";
    case EPX__BENCH_LL_COMBINE_SEND:
        return "combine_send";
    case EPX__BENCH_LL_COMBINE_RECV:
        return "combine_recv";
    case EPX__BENCH_LL_LOOP_DISPATCH:
        return "dispatch_loop";
    case EPX__BENCH_LL_LOOP_COMBINE:
        return "combine_loop";
    case EPX__BENCH_LL_LOOP_STEP:
        return "step_loop";
    case EPX__BENCH_LL_LOOP_SPLIT:
        return "step_split_loop";
    case EPX__BENCH_LL_GRAPH_STEP:
        return "step_graph";
    case EPX__BENCH_LL_LAUNCH_LAG:
        return "launch_lag";
    case EPX__BENCH_LL_DISPATCH_AFTER_LAST:
        return "dispatch_after_last";
    default:
        return "unknown";
    }
}

epx__bench_stats_t epx__bench_stats(const double *values, int count)
{
    epx__bench_stats_t stats = {NAN, NAN, NAN};
    if (count <= 0)
        return stats;
    double *sorted = malloc((size_t)count * sizeof(double));
    if (sorted == NULL)
        return stats; /* printed as missing: a number that cannot be computed */
    memcpy(sorted, values, (size_t)count * sizeof(double));
    stats.median_us = epx__bench_median(sorted, count);
    stats.p99_us = epx__bench_p99(sorted, count);
    stats.mean_us = epx__bench_mean(sorted, count);
    free(sorted);
    return stats;
}

static const char *scales_text(const epx__bench_ll_context_t *ll)
{
    if (ll->use_ue8m0)
        return "UE8M0 exponents, four per int32 (round_scale + use_ue8m0)";
    if (ll->round_scale)
        return "power-of-two fp32 scales (round_scale)";
    return "fp32 scales";
}

static double floor_us(const epx__bench_ll_context_t *ll, const epx__bench_ll_row_t *row)
{
    return epx__bench_copy_time_us(row->floor_bytes, ll->context->floor_bw_gbps);
}

void epx__bench_ll_print_header(FILE *out, const epx__bench_ll_context_t *ll)
{
    const epx__bench_context_t *c = ll->context;
    char total[32], low_latency[32];
    epx__bench_format_bytes(ll->buffer_bytes, total, sizeof(total));
    epx__bench_format_bytes(ll->ll_buffer_bytes, low_latency, sizeof(low_latency));
    fprintf(out,
            "# epx bench --mode ll: backend %s, %d ranks, tokens %lld hidden %lld experts %d "
            "topk %d seed %llu",
            c->backend, c->ranks, (long long)c->tokens, (long long)c->hidden, c->experts,
            c->topk, (unsigned long long)c->seed);
    epx__bench_print_sms(out, c);
    fprintf(out, ", warmup %d iters %d\n", c->warmup, c->iters);
    fprintf(out, "# dispatch: x bf16 in; fp8 rows carry %s, one per 128 channels; combine: bf16, "
                 "x in the zero-copy buffer (epx_ll_get_combine_buffer)\n",
            scales_text(ll));
    fprintf(out, "# buffer: %s per rank (epx_buffer_size), %s of it for low latency "
                 "(max_low_latency_tokens %lld, low_latency_dtype %s: rows sized for %s)\n",
            total, low_latency, (long long)c->tokens, epx__bench_dtype_text(ll->ll_dtype),
            ll->ll_dtype == EPX_DTYPE_FP8_E4M3 ? "fp8 dispatch only" : "bf16 or fp8 dispatch");
    epx__bench_print_floor_header(
        out, c,
        "dispatch: each source token once (bf16 x, top-k ids) + each row received once (fp8 + "
        "scales, or bf16);\n#   combine: each row received once + each token's top-k ids, "
        "weights and output row once; steps: both; the send and receive halves: none");
    fprintf(out, "# median, p99, mean: rank 0's times in us; slowest: each iteration's slowest "
                 "rank, median and p99;\n"
                 "# MB/rank: rank 0's rows sent x row bytes; GB/s = MB/rank / rank 0's median;\n"
                 "# *_send, *_recv: the split, each half alone (the receive starts once every "
                 "rank's send has finished)\n");
    fprintf(out, "# %-5s %-14s %10s %10s %10s %11s %11s %8s %9s %9s %10s %5s\n", "dtype", "op",
            "median_us", "p99_us", "mean_us", "slowest_us", "slowest_p99", "MB/rank", "GB/s/rank",
            "floor_us", "floor/time", "check");
    fflush(out);
}

static void print_table_row(FILE *out, const epx__bench_ll_context_t *ll,
                            const epx__bench_ll_row_t *row)
{
    double floor = floor_us(ll, row);
    fprintf(out, "  %-5s %-14s ", epx__bench_dtype_text(row->dtype),
            epx__bench_ll_op_name(row->op));
    const double numbers[] = {row->rank0.median_us, row->rank0.p99_us, row->rank0.mean_us};
    for (size_t i = 0; i < sizeof(numbers) / sizeof(numbers[0]); i++) {
        epx__bench_print_number(out, 10, 1, numbers[i], "-");
        fputc(' ', out);
    }
    epx__bench_print_number(out, 11, 1, row->slowest.median_us, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 11, 1, row->slowest.p99_us, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 8, 2, row->bytes_per_rank > 0 ? row->bytes_per_rank / 1e6 : NAN,
                            "-");
    fputc(' ', out);
    epx__bench_print_number(out, 9, 2, epx__bench_gbps(row->bytes_per_rank, row->rank0.median_us),
                            "-");
    fputc(' ', out);
    epx__bench_print_number(out, 9, 2, floor, "-");
    fputc(' ', out);
    epx__bench_print_number(out, 10, 2, epx__bench_floor_over_time(floor, row->slowest.median_us),
                            "-");
    fprintf(out, " %5s\n", epx__bench_check_text(row->check));
}

typedef enum { STAT_MEDIAN, STAT_P99, STAT_MEAN } stat_t;

static double stat_of(const epx__bench_stats_t *stats, stat_t which)
{
    return which == STAT_MEDIAN ? stats->median_us
                                : which == STAT_P99 ? stats->p99_us : stats->mean_us;
}

/* ",\"key\":[rank 0's, rank 1's, ...]" of one statistic. */
static void print_json_per_rank(FILE *out, const char *key, const epx__bench_stats_t *per_rank,
                                int ranks, stat_t which)
{
    fprintf(out, ",\"%s\":[", key);
    for (int r = 0; r < ranks; r++) {
        double value = stat_of(&per_rank[r], which);
        if (isfinite(value))
            fprintf(out, "%s%.6g", r > 0 ? "," : "", value);
        else
            fprintf(out, "%snull", r > 0 ? "," : "");
    }
    fputc(']', out);
}

/* Strings printed here are our own fixed words (no quotes or backslashes to escape). */
static void print_json_row(FILE *out, const epx__bench_ll_context_t *ll,
                           const epx__bench_ll_row_t *row)
{
    const epx__bench_context_t *c = ll->context;
    int fp8 = row->dtype == EPX_DTYPE_FP8_E4M3;
    fprintf(out, "{\"mode\":\"ll\",\"backend\":\"%s\",\"ranks\":%d,\"tokens\":%lld,"
                 "\"hidden\":%lld,\"experts\":%d,\"topk\":%d,\"seed\":%llu,"
                 "\"warmup\":%d,\"iters\":%d,\"dtype\":\"%s\",\"round_scale\":%d,"
                 "\"use_ue8m0\":%d,\"combine_dtype\":\"bf16\",\"op\":\"%s\"",
            c->backend, c->ranks, (long long)c->tokens, (long long)c->hidden, c->experts,
            c->topk, (unsigned long long)c->seed, c->warmup, c->iters,
            epx__bench_dtype_text(row->dtype), fp8 && ll->round_scale, fp8 && ll->use_ue8m0,
            epx__bench_ll_op_name(row->op));
    epx__bench_print_json_number(out, "sms", c->sms > 0 ? c->sms : NAN);
    epx__bench_print_json_number(out, "median_us", row->rank0.median_us);
    epx__bench_print_json_number(out, "p99_us", row->rank0.p99_us);
    epx__bench_print_json_number(out, "mean_us", row->rank0.mean_us);
    epx__bench_print_json_number(out, "slowest_median_us", row->slowest.median_us);
    epx__bench_print_json_number(out, "slowest_p99_us", row->slowest.p99_us);
    epx__bench_print_json_number(out, "slowest_mean_us", row->slowest.mean_us);
    print_json_per_rank(out, "per_rank_median_us", row->per_rank, c->ranks,
                        STAT_MEDIAN);
    print_json_per_rank(out, "per_rank_p99_us", row->per_rank, c->ranks,
                        STAT_P99);
    print_json_per_rank(out, "per_rank_mean_us", row->per_rank, c->ranks,
                        STAT_MEAN);
    epx__bench_print_json_traffic(out, c, row->bytes_per_rank, row->total_bytes, row->floor_bytes,
                                  row->rank0.median_us, row->slowest.median_us);
    fprintf(out, ",\"buffer_bytes_per_rank\":%lld,\"ll_buffer_bytes_per_rank\":%lld,"
                 "\"ll_dtype\":\"%s\"",
            (long long)ll->buffer_bytes, (long long)ll->ll_buffer_bytes,
            epx__bench_dtype_text(ll->ll_dtype));
    epx__bench_print_json_check_end(out, row->check);
}

void epx__bench_ll_print_row(FILE *out, const epx__bench_ll_context_t *ll,
                             const epx__bench_ll_row_t *row, int json)
{
    if (json)
        print_json_row(out, ll, row);
    else
        print_table_row(out, ll, row);
    fflush(out);
}

/* Rank r's wait for rank s in op (0 dispatch, 1 combine): waits is [rank][op][source]. */
static int64_t wait_ns(const int64_t *waits, int ranks, int r, int op, int s)
{
    return waits[((size_t)r * 2 + (size_t)op) * (size_t)ranks + (size_t)s];
}

void epx__bench_ll_print_waits(FILE *out, const epx__bench_ll_context_t *ll, epx_dtype_t dtype,
                               const int64_t *waits, int json)
{
    static const char *const ops[2] = {"dispatch", "combine"};
    int ranks = ll->context->ranks;
    if (json) {
        fprintf(out, "{\"dtype\":\"%s\",\"wait_recv_cost_stats_ns\":{",
                epx__bench_dtype_text(dtype));
        for (int op = 0; op < 2; op++) {
            fprintf(out, "%s\"%s\":[", op ? "," : "", ops[op]);
            for (int r = 0; r < ranks; r++) {
                fprintf(out, "%s[", r ? "," : "");
                for (int s = 0; s < ranks; s++)
                    fprintf(out, "%s%lld", s ? "," : "",
                            (long long)wait_ns(waits, ranks, r, op, s));
                fputc(']', out);
            }
            fputc(']', out);
        }
        fputs("}}\n", out);
    } else {
        fprintf(out, "# %s wait_recv_cost_stats (--wait-stats): ms each rank's receives waited "
                     "for ranks 0..%d, summed over every call of the run:\n",
                epx__bench_dtype_text(dtype), ranks - 1);
        for (int op = 0; op < 2; op++)
            for (int r = 0; r < ranks; r++) {
                fprintf(out, "#   %-8s rank %-3d", ops[op], r);
                for (int s = 0; s < ranks; s++) {
                    fputc(' ', out);
                    epx__bench_print_number(
                        out, 9, 2,
                        (double)wait_ns(waits, ranks, r, op, s) / 1e6,
                        "-");
                }
                fputc('\n', out);
            }
    }
    fflush(out);
}

void epx__bench_ll_print_per_rank(FILE *out, const epx__bench_ll_context_t *ll,
                                  const epx__bench_ll_row_t *rows, int count)
{
    int ranks = ll->context->ranks;
    fprintf(out, "# per rank, median_us of ranks 0..%d:\n", ranks - 1);
    for (int i = 0; i < count; i++) {
        fprintf(out, "#   %-5s %-14s", epx__bench_dtype_text(rows[i].dtype),
                epx__bench_ll_op_name(rows[i].op));
        for (int r = 0; r < ranks; r++) {
            fputc(' ', out);
            epx__bench_print_number(out, 9, 1, rows[i].per_rank[r].median_us, "-");
        }
        fputc('\n', out);
    }
    fflush(out);
}
