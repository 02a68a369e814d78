/*
 * `epx bench --mode fanout`: the copy normal-mode dispatch does, alone, to measure the
 * ceiling of its access pattern on the machine rather than assume it; and the sum
 * normal-mode combine does, alone, for the ceiling of its pattern (the fan-in rows).
 *
 * Every rank copies --tokens source rows; each goes to --fanout ranks on average (5.25,
 * about what a standard dispatch sends a token to, or every rank when there are fewer), into their combine-input regions
 * through the same mapping normal mode uses (CUDA IPC), with the buffer's SM budget
 * (epx_fanout_copy, include/epx_tool.h). Rows, per dispatch dtype asked for (bf16: hidden
 * x 2 bytes a row; fp8: hidden bytes):
 *   vector          the vector dispatch kernel's copy loop (registers, 16-byte vectors)
 *   bulk            the bulk dispatch kernel's ring (TMA through shared memory), with its
 *                   shared-memory budget; bulk_2 with two row slots per warp (fewer
 *                   bytes in flight: how much the ring's depth matters)
 *   staged          one warp a block bulk-loads rows into a ring in shared memory, the
 *                   other 16 store them from there (the staged dispatch kernel's,
 *                   EPX_NORMAL_KERNELS=3); staged_4 with four row slots instead of eight
 *   vector, bulk, staged  the same with fanout 1: a plain copy of each row
 *   copy_engine     no SMs: each rank copies fanout x tokens rows with cudaMemcpyAsync,
 *                   all ranks at once (what combine from a tensor outside the buffer must
 *                   copy in first, done by the copy engines)
 *   fanin           bf16 only: combine's pattern (epx_fanin_reduce), each output row the
 *                   fp32 sum of the rows at --fanout ranks on average (read from their
 *                   combine-input regions where the fan-out wrote them, through the same
 *                   mapping), written once to this rank's memory, with the vector combine
 *                   kernel's loads in flight; then with fanin 1 (one source a row)
 * Each row: rank 0's median, the slowest rank's median, every rank's bytes read +
 * written (fan-out: each source row once + each copy; fan-in: each term read + each
 * output row once; the same count), GB/s (those bytes over the slowest median), GB/s per SM, and the fraction of
 * the copy bandwidth: measured by rank 0 alone (epx__bench_floor_bandwidth:
 * cudaMemcpyAsync of 2 GiB, as tests/gpu/cuda_normal measures it; before 2026-12-05 of
 * 256 MiB, which measures 3-5% less), the floor's own measurement at the start unless
 * --floor-bw gave the floor, and the floor's bandwidth.
 * Nothing makes the ranks' copies overlap (no rank waits for another inside one), so
 * when they start apart each runs partly alone and bytes / slowest overstates the
 * bandwidth (past the floor: 2026-12-04, 16 SMs a rank); each row also gives the span,
 * from the first rank issuing its copy to the last rank's copy finished on the host
 * clock, and the floor fraction over it, which can only understate.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/tool.h"
#include "epx_tool.h"


typedef enum {
    FANOUT_COPY = 0,   /* epx_fanout_copy */
    FANOUT_ENGINE = 1, /* the copy engines (epx__bench_copy) */
    FANIN_REDUCE = 2,  /* epx_fanin_reduce: bf16 rows only */
} fanout_call_t;

typedef struct {
    const char *name;
    fanout_call_t call;
    epx_fanout_kernel_t kernel; /* epx_fanout_copy */
    int plain;                  /* fanout (fanin) 1 instead of the option's */
    int stages;                 /* bulk: slots per warp; staged: of the block; 0 = default */
} fanout_variant_t;

static const fanout_variant_t variants[] = {
    {"vector", FANOUT_COPY, EPX_FANOUT_VECTOR, 0, 0},
    {"bulk", FANOUT_COPY, EPX_FANOUT_BULK, 0, 0},
    {"bulk_2", FANOUT_COPY, EPX_FANOUT_BULK, 0, 2},
    {"staged", FANOUT_COPY, EPX_FANOUT_STAGED, 0, 0},
    {"staged_4", FANOUT_COPY, EPX_FANOUT_STAGED, 0, 4},
    {"vector", FANOUT_COPY, EPX_FANOUT_VECTOR, 1, 0},
    {"bulk", FANOUT_COPY, EPX_FANOUT_BULK, 1, 0},
    {"staged", FANOUT_COPY, EPX_FANOUT_STAGED, 1, 0},
    {"copy_engine", FANOUT_ENGINE, EPX_FANOUT_VECTOR, 0, 0},
    {"fanin", FANIN_REDUCE, EPX_FANOUT_VECTOR, 0, 0},
    {"fanin", FANIN_REDUCE, EPX_FANOUT_VECTOR, 1, 0},
};
#define NUM_VARIANTS ((int)(sizeof(variants) / sizeof(variants[0])))

typedef struct {
    epx_group_t group;
    epx_buffer_t buffer;
    epx__bench_device_t *device;
    const epx__bench_options_t *options;
    const epx__bench_context_t *context;
    int rank;
    int world_size;
    void *src;         /* tokens rows of hidden * 2 bytes */
    void *dst;         /* fanin: tokens rows of hidden * 2 bytes */
    void *engine_src;  /* copy_engine: fanout x tokens rows */
    void *engine_dst;
    double fanout;     /* destinations per row on average */
    double copy_gbps;  /* measured on rank 0 */
    size_t copy_bytes; /* the size of that copy */
} fanout_bench_t;

/* Rows the fan-out writes for `rows` source rows (epx_tool.h's k_i summed). */
static int64_t written_rows(int64_t rows, double fanout)
{
    int64_t milli = (int64_t)(fanout * 1000.0 + 0.5);
    return rows * milli / 1000;
}

/* One timed call: its duration on this rank (us, the stream's own timestamps), and the
 * host clock (CLOCK_MONOTONIC, ns, one clock for every rank of a host) just before it was
 * issued and just after the stream finished it. */
typedef struct {
    double us;
    double issued_ns, finished_ns;
} fanout_time_t;

static fanout_time_t run_once(fanout_bench_t *b, const fanout_variant_t *variant,
                              int64_t row_bytes)
{
    const epx__bench_options_t *o = b->options;
    fanout_time_t time;
    epx__bench_must(b->rank, epx_group_barrier(b->group), "epx_group_barrier");
    time.issued_ns = (double)epx__tool_now_ns();
    epx__bench_must(b->rank, epx__bench_mark(b->device, 0), "timestamp");
    if (variant->call == FANOUT_ENGINE) {
        size_t bytes = (size_t)written_rows(o->tokens, b->fanout) * (size_t)row_bytes;
        epx__bench_must(b->rank, epx__bench_copy(b->device, b->engine_dst, b->engine_src, bytes),
                        "copy-engine copy");
    } else if (variant->call == FANIN_REDUCE) {
        epx_fanin_args_t args = EPX_FANIN_ARGS_INIT;
        args.dst = b->dst;
        args.dst_pitch = row_bytes;
        args.rows = o->tokens;
        args.row_bytes = row_bytes;
        args.fanin = variant->plain ? 1.0 : b->fanout;
        epx__bench_must(b->rank, epx_fanin_reduce(b->buffer, &args, b->device->stream),
                        "epx_fanin_reduce");
    } else {
        epx_fanout_args_t args = EPX_FANOUT_ARGS_INIT;
        args.kernel = variant->kernel;
        args.src = b->src;
        args.src_pitch = row_bytes;
        args.rows = o->tokens;
        args.row_bytes = row_bytes;
        args.fanout = variant->plain ? 1.0 : b->fanout;
        args.stages = variant->stages;
        epx__bench_must(b->rank, epx_fanout_copy(b->buffer, &args, b->device->stream),
                        "epx_fanout_copy");
    }
    epx__bench_must(b->rank, epx__bench_mark(b->device, 1), "timestamp");
    epx__bench_must(b->rank, epx__bench_elapsed_us(b->device, 2, &time.us), "reading timestamps");
    time.finished_ns = (double)epx__tool_now_ns();
    /* Nobody starts the next copy into a region before every rank finished this one. */
    epx__bench_must(b->rank, epx_group_barrier(b->group), "epx_group_barrier");
    return time;
}

static void print_header(const fanout_bench_t *b)
{
    const epx__bench_context_t *c = b->context;
    printf("# epx bench --mode fanout: backend %s, %d ranks, rows %lld per rank, hidden %lld, "
           "fanout %.2f",
           c->backend, c->ranks, (long long)c->tokens, (long long)c->hidden,
           b->fanout);
    epx__bench_print_sms(stdout, c);
    printf(", warmup %d iters %d\n", c->warmup, c->iters);
    printf("# copy bandwidth: %.1f GB/s measured (rank 0 alone, %s of %zu MiB, read + write); "
           "floor bandwidth %.1f GB/s (%s)\n",
           b->copy_gbps,
           b->device->backend == EPX_BACKEND_CUDA ? "a device-to-device cudaMemcpyAsync"
                                                  : "a memcpy",
           b->copy_bytes >> 20, c->floor_bw_gbps, c->floor_source);
    printf("# bytes: every rank's rows read once + written once per destination (fanin: each "
           "of a row's sources read once + the row written once; fanout = sources per row); "
           "GB/s = bytes / slowest; of_copy, of_floor: GB/s over those bandwidths\n");
    printf("# span: from the first rank issuing a copy to the last rank's copy finished (host "
           "clock, so a little long); the ranks' copies need not overlap, so bytes / slowest can "
           "pass the floor when they start apart: span_floor = bytes / span over the floor's "
           "bandwidth, a bound from below\n");
    printf("# %-5s %-12s %6s %11s %11s %10s %9s %8s %7s %8s %9s %10s\n", "dtype", "kernel",
           "fanout", "median_us", "slowest_us", "GB", "GB/s", "GB/s/SM", "of_copy", "of_floor",
           "span_us", "span_floor");
    fflush(stdout);
}

static void print_row(const fanout_bench_t *b, const char *dtype, const fanout_variant_t *v,
                      double fanout, double median_us, double slowest_us, double span_us,
                      int64_t bytes)
{
    const epx__bench_context_t *c = b->context;
    double gbps = slowest_us > 0 ? (double)bytes / (slowest_us * 1e3) : NAN;
    double span_of_floor = span_us > 0 && c->floor_bw_gbps > 0
                               ? (double)bytes / (span_us * 1e3) / c->floor_bw_gbps
                               : NAN;
    /* The copy engines use no SMs. */
    double per_sm = v->call != FANOUT_ENGINE && c->sms > 0 ? gbps / ((double)c->sms * c->ranks) : NAN;
    double of_copy = b->copy_gbps > 0 ? gbps / b->copy_gbps : NAN;
    double of_floor = c->floor_bw_gbps > 0 ? gbps / c->floor_bw_gbps : NAN;
    if (b->options->json) {
        printf("{\"mode\":\"fanout\",\"backend\":\"%s\",\"ranks\":%d,\"rows\":%lld,"
               "\"hidden\":%lld,\"warmup\":%d,\"iters\":%d,\"dtype\":\"%s\",\"kernel\":\"%s\"",
               c->backend, c->ranks, (long long)c->tokens, (long long)c->hidden, c->warmup,
               c->iters, dtype, v->name);
        epx__bench_print_json_number(stdout, "sms", c->sms > 0 ? c->sms : NAN);
        epx__bench_print_json_number(stdout, "fanout", fanout);
        epx__bench_print_json_number(stdout, "median_us", median_us);
        epx__bench_print_json_number(stdout, "slowest_median_us", slowest_us);
        printf(",\"total_bytes\":%lld", (long long)bytes);
        epx__bench_print_json_number(stdout, "gbps", gbps);
        epx__bench_print_json_number(stdout, "gbps_per_sm", per_sm);
        epx__bench_print_json_number(stdout, "copy_gbps", b->copy_gbps > 0 ? b->copy_gbps : NAN);
        epx__bench_print_json_number(stdout, "of_copy", of_copy);
        epx__bench_print_json_number(stdout, "of_floor", of_floor);
        epx__bench_print_json_number(stdout, "span_median_us", span_us);
        epx__bench_print_json_number(stdout, "span_of_floor", span_of_floor);
        printf("}\n");
    } else {
        printf("  %-5s %-12s %6.2f ", dtype, v->name, fanout);
        epx__bench_print_number(stdout, 11, 1, median_us, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 11, 1, slowest_us, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 10, 3, (double)bytes / 1e9, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 9, 1, gbps, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 8, 1, per_sm, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 7, 2, of_copy, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 8, 2, of_floor, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 9, 1, span_us, "-");
        putchar(' ');
        epx__bench_print_number(stdout, 10, 2, span_of_floor, "-");
        putchar('\n');
    }
    fflush(stdout);
}

/* Time one variant for one row size; rank 0 prints its row. */
static void run_variant(fanout_bench_t *b, const char *dtype, const fanout_variant_t *v,
                        int64_t row_bytes)
{
    const epx__bench_context_t *c = b->context;
    int iters = c->iters;
    size_t per_rank_bytes = (size_t)iters * sizeof(fanout_time_t);
    fanout_time_t *mine = calloc((size_t)iters, sizeof(fanout_time_t));
    fanout_time_t *all = calloc((size_t)iters * (size_t)b->world_size, sizeof(fanout_time_t));
    double *own = calloc((size_t)iters, sizeof(double));
    double *slowest = calloc((size_t)iters, sizeof(double));
    double *span = calloc((size_t)iters, sizeof(double));
    if (mine == NULL || all == NULL || own == NULL || slowest == NULL || span == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory\n", b->rank);
        exit(1);
    }
    for (int it = 0; it < c->warmup + iters; it++) {
        fanout_time_t time = run_once(b, v, row_bytes);
        if (it >= c->warmup)
            mine[it - c->warmup] = time;
    }
    epx__bench_allgather(b->group, mine, all, per_rank_bytes, "gathering times");
    for (int it = 0; it < iters; it++) {
        own[it] = mine[it].us;
        double issued = all[it].issued_ns, finished = all[it].finished_ns;
        for (int r = 0; r < b->world_size; r++) {
            const fanout_time_t *t = &all[(size_t)r * (size_t)iters + (size_t)it];
            slowest[it] = t->us > slowest[it] ? t->us : slowest[it];
            issued = t->issued_ns < issued ? t->issued_ns : issued;
            finished = t->finished_ns > finished ? t->finished_ns : finished;
        }
        span[it] = (finished - issued) / 1e3;
    }
    double fanout = v->plain ? 1.0 : b->fanout;
    int64_t rows = b->options->tokens;
    /* Reads: each source row once (the copy engines: each copied row); writes: each copy.
     * The fan-in the other way round: each of the row's sources read, each row written
     * once; as many bytes as the fan-out at the same fanout. */
    int64_t written = written_rows(rows, fanout);
    int64_t per_rank =
        v->call == FANOUT_ENGINE ? 2 * written * row_bytes : (rows + written) * row_bytes;
    if (b->rank == 0)
        print_row(b, dtype, v, fanout, epx__bench_median(own, iters),
                  epx__bench_median(slowest, iters), epx__bench_median(span, iters),
                  per_rank * b->world_size);
    free(mine);
    free(all);
    free(own);
    free(slowest);
    free(span);
}

int epx__bench_fanout_run(epx_group_t group, const epx__bench_options_t *options,
                          epx__bench_device_t *device, const epx__bench_context_t *context)
{
    fanout_bench_t b;
    memset(&b, 0, sizeof(b));
    b.group = group;
    b.device = device;
    b.options = options;
    b.context = context;
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    b.rank = info.rank;
    b.world_size = info.world_size;
    b.fanout = options->fanout > 0 ? options->fanout : 5.25;
    if (options->fanout == 0 && b.fanout > info.world_size)
        b.fanout = info.world_size;
    if (b.fanout > info.world_size) {
        if (b.rank == 0)
            fprintf(stderr, "epx bench: --fanout %.2f is more than the %d ranks\n", b.fanout,
                    info.world_size);
        /* No rank leaves before rank 0 has said why (the launcher stops the others). */
        fflush(stderr);
        epx_group_barrier(group);
        return 2;
    }

    epx_buffer_config_t config = epx__bench_buffer_config(options);
    epx__bench_must(b.rank, epx_buffer_create(group, &config, &b.buffer), "epx_buffer_create");

    size_t row_bytes = (size_t)options->hidden * 2;
    size_t engine_bytes = (size_t)written_rows(options->tokens, b.fanout) * row_bytes;
    epx__bench_must(b.rank, epx__bench_alloc(device, (size_t)options->tokens * row_bytes, &b.src),
                    "bench allocation");
    epx__bench_must(b.rank, epx__bench_fill(device, b.src, 0x3c, (size_t)options->tokens * row_bytes),
                    "bench fill");
    epx__bench_must(b.rank, epx__bench_alloc(device, engine_bytes, &b.engine_src),
                    "bench allocation");
    epx__bench_must(b.rank, epx__bench_alloc(device, engine_bytes, &b.engine_dst),
                    "bench allocation");
    epx__bench_must(b.rank, epx__bench_alloc(device, (size_t)options->tokens * row_bytes, &b.dst),
                    "bench allocation");

    /* The copy bandwidth: the floor's, measured at the start (bench.c), or, when the
     * floor was given, measured here by rank 0 while the others wait. */
    if (options->floor_bw_gbps > 0) {
        epx__bench_must(b.rank, epx_group_barrier(group), "epx_group_barrier");
        if (b.rank == 0)
            b.copy_gbps = epx__bench_floor_bandwidth(device, &b.copy_bytes);
        epx__bench_must(b.rank, epx_group_barrier(group), "epx_group_barrier");
    } else if (b.rank == 0 && context->floor_copy_bytes > 0) {
        b.copy_gbps = context->floor_bw_gbps;
        b.copy_bytes = context->floor_copy_bytes;
    }

    if (b.rank == 0 && !options->json)
        print_header(&b);
    const char *dtypes[] = {"bf16", "fp8"};
    const int64_t widths[] = {2, 1};
    for (int d = 0; d < 2; d++) {
        if ((d == 0 && !options->run_bf16) || (d == 1 && !options->run_fp8))
            continue;
        /* Combine's rows are bf16: no fp8 fan-in. */
        for (int v = 0; v < NUM_VARIANTS; v++)
            if (d == 0 || variants[v].call != FANIN_REDUCE)
                run_variant(&b, dtypes[d], &variants[v], options->hidden * widths[d]);
    }

    epx__bench_free(device, b.src);
    epx__bench_free(device, b.engine_src);
    epx__bench_free(device, b.engine_dst);
    epx__bench_free(device, b.dst);
    epx__bench_must(b.rank, epx_buffer_destroy(b.buffer), "epx_buffer_destroy");
    return 0;
}
