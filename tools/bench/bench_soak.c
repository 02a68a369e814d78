/*
 * `epx bench --soak DURATION`: the driver (bench_soak.h has the overview).
 *
 * Schedule. Every rank draws round n's shape from (seed, n), so the ranks agree on every
 * round without talking. Every few rounds they exchange a few words through the group's
 * rendezvous channel, off the timed path: rank 0's clock decides when a window ends
 * and when the soak stops, and every rank says whether it failed, so that they all stop
 * together. A window's end gathers each rank's latency percentiles, memory and counts;
 * rank 0 prints one line for it (the worst rank's figure for each), and a summary at
 * the end: drift of p99 from the first window to the last, memory growth since the end
 * of the first window (the warm-up), mismatches, failures.
 *
 * Fault injection (--inject kill|stop RANK@SECONDS, low-latency rounds only). At the
 * sync after the moment, rank 0 turns the rest of the soak into a number of rounds from
 * the rate so far (the rendezvous channel goes through rank 0 and cannot be trusted
 * after a rank is lost), the victim dies (SIGKILL) or falls silent (sleeps past the
 * end), and the survivors keep serving: their waits mask the lost rank and complete the
 * step without it (include/epx.h). The first call that lost it gives the detection time.
 * After that the lowest surviving rank prints its own windows. A killed victim runs as
 * a child of its rank's process, which exits 0 when the child died as planned, so that
 * `epx launch` does not stop the survivors.
 *
 * Rejoin (--rejoin-after D, with kill). At the injection rank 0 also plans the rejoin:
 * the round it comes at (from the rate so far) and the unique id of its group, both in
 * the control words. The victim's parent starts the replacement (bench_soak_rejoin.c);
 * at that round the survivors form the group with it and call epx_ll_rejoin, all of them
 * take the first survivor's round and clock, and the soak goes back to the synced phase
 * over the new group, the rank unmasked: every later round is checked with it in.
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/args.h"
#include "bench.h"
#include "bench_soak.h"
#include "common/tool.h"

#define SYNC_ROUNDS 4 /* rounds between two exchanges of the control words */

const char epx__soak_usage[] =
    "\nsoak (the stability check; windows of latency percentiles, memory and failures):\n"
    "  --soak DURATION   run rounds of fresh random shapes for DURATION (90s, 10m, 72h),\n"
    "                    a sample checked against the oracle; exit 1 on a mismatch\n"
    "  --window S        seconds per report window (60, or a tenth of a shorter soak)\n"
    "  --check-every N   check one round in N against the oracle (4; 1 = every round)\n"
    "  --soak-modes M    normal, ll or both (both): which mode's rounds to run\n"
    "  --ll-tokens N     low-latency rounds: the buffer's max_low_latency_tokens (128)\n"
    "  --inject K R@T    kill or stop rank R T seconds into the soak (low-latency rounds):\n"
    "                    the others must mask it and keep serving\n"
    "  --rejoin-after D  with --inject kill (CPU backend): D after the kill a new process\n"
    "                    takes the rank's place and rejoins; later rounds checked with it\n";

const char *epx__soak_op_name(epx__soak_op_t op)
{
    static const char *const names[EPX__SOAK_OP_COUNT] = {"dispatch", "cached_dispatch",
                                                          "combine", "ll_dispatch",
                                                          "ll_combine"};
    return (int)op >= 0 && op < EPX__SOAK_OP_COUNT ? names[op] : "?";
}

/* ---------------------------------------------------------------- options */

/* "90", "90s", "10m", "72h", "1.5h" in seconds; -1 when not a duration. */
static double parse_duration(const char *text)
{
    char *end = NULL;
    double value = strtod(text, &end);
    if (end == text || !(value > 0) || !isfinite(value))
        return -1;
    double unit = 1;
    if (*end == 'm')
        unit = 60, end++;
    else if (*end == 'h')
        unit = 3600, end++;
    else if (*end == 's')
        end++;
    return *end == '\0' ? value * unit : -1;
}

static int bad(const char *flag, const char *value)
{
    fprintf(stderr, "epx bench: bad value for %s: '%s'\n", flag, value != NULL ? value : "");
    return -1;
}

int epx__soak_match(int argc, char **argv, int *index, epx__soak_options_t *soak)
{
    const char *value = NULL;
    int64_t number = 0;
    int matched;
    if ((matched = epx__match_value(argc, argv, index, "--soak", &value)) != 0) {
        if (matched < 0 || (soak->duration_s = parse_duration(value)) <= 0)
            return bad("--soak", value);
    } else if ((matched = epx__match_value(argc, argv, index, "--window", &value)) != 0) {
        if (matched < 0 || (soak->window_s = parse_duration(value)) <= 0)
            return bad("--window", value);
    } else if ((matched = epx__match_value(argc, argv, index, "--check-every", &value)) != 0) {
        if (matched < 0 || epx__parse_int64(value, 1, 1 << 30, &number) != 0)
            return bad("--check-every", value);
        soak->check_every = (int)number;
    } else if ((matched = epx__match_value(argc, argv, index, "--soak-modes", &value)) != 0) {
        if (matched < 0)
            return bad("--soak-modes", value);
        soak->run_normal = strcmp(value, "normal") == 0 || strcmp(value, "both") == 0;
        soak->run_ll = strcmp(value, "ll") == 0 || strcmp(value, "both") == 0;
        if (!soak->run_normal && !soak->run_ll)
            return bad("--soak-modes", value);
    } else if ((matched = epx__match_value(argc, argv, index, "--ll-tokens", &value)) != 0) {
        if (matched < 0 || epx__parse_int64(value, 1, 65536, &number) != 0)
            return bad("--ll-tokens", value);
        soak->ll_tokens = number;
    } else if ((matched = epx__match_value(argc, argv, index, "--inject", &value)) != 0) {
        /* --inject kill 2@30 (two words) */
        if (matched < 0 || *index + 1 >= argc)
            return bad("--inject", value);
        const char *at = argv[++*index];
        char *end = NULL;
        long rank = strtol(at, &end, 10);
        soak->inject = strcmp(value, "kill") == 0   ? EPX__SOAK_INJECT_KILL
                       : strcmp(value, "stop") == 0 ? EPX__SOAK_INJECT_STOP
                                                    : EPX__SOAK_INJECT_NONE;
        if (soak->inject == EPX__SOAK_INJECT_NONE || end == at || *end != '@' || rank < 0 ||
            (soak->inject_at_s = parse_duration(end + 1)) <= 0)
            return bad("--inject", at);
        soak->inject_rank = (int)rank;
    } else if ((matched = epx__match_value(argc, argv, index, "--rejoin-after", &value)) != 0) {
        if (matched < 0 || (soak->rejoin_after_s = parse_duration(value)) <= 0)
            return bad("--rejoin-after", value);
    } else if ((matched = epx__match_value(argc, argv, index, "--soak-rejoin", &value)) != 0) {
        if (matched < 0 || strlen(value) >= sizeof(soak->rejoin_id))
            return bad("--soak-rejoin", value);
        snprintf(soak->rejoin_id, sizeof(soak->rejoin_id), "%s", value);
    } else {
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- helpers */

uint64_t epx__soak_random(uint64_t *state)
{
    /* splitmix64: every round's stream from its seed, the same on every rank */
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int64_t epx__soak_below(uint64_t *state, int64_t bound)
{
    return bound > 0 ? (int64_t)(epx__soak_random(state) % (uint64_t)bound) : 0;
}

void epx__soak_draw_routing(uint64_t *state, int world, const double *drops, int count,
                            moe_case_t *c)
{
    c->seed = epx__soak_random(state);
    static const moe_routing_t routings[] = {MOE_ROUTING_RANDOM, MOE_ROUTING_RANDOM,
                                             MOE_ROUTING_LOCAL_FIRST, MOE_ROUTING_ONE_EXPERT,
                                             MOE_ROUTING_REPEAT};
    c->routing = routings[epx__soak_below(state, 5)];
    if (c->routing == MOE_ROUTING_REPEAT && c->num_topk < 2)
        c->routing = MOE_ROUTING_RANDOM;
    c->drop_fraction = drops[epx__soak_below(state, count)];
    c->empty_rank = epx__soak_below(state, 8) == 0 ? (int)epx__soak_below(state, world) : -1;
}

epx_status_t epx__soak_copy_inputs(epx__soak_t *soak, const moe_case_t *c, const moe_inputs_t *in,
                                   size_t x_bytes, size_t scale_bytes)
{
    size_t entries = (size_t)(in->num_tokens * c->num_topk);
    epx_status_t status = epx__bench_copy_in(soak->device, soak->x, in->x, x_bytes);
    if (status == EPX_SUCCESS && scale_bytes > 0)
        status = epx__bench_copy_in(soak->device, soak->x_scales, in->x_scales, scale_bytes);
    if (status == EPX_SUCCESS)
        status = epx__bench_copy_in(soak->device, soak->topk_idx, in->topk_idx, entries * 8);
    if (status == EPX_SUCCESS)
        status = epx__bench_copy_in(soak->device, soak->topk_weights, in->topk_weights,
                                    entries * 4);
    return status;
}

void epx__soak_mark(epx__soak_t *soak, int index)
{
    epx__bench_mark(soak->device, index);
}

void epx__soak_start_op(epx__soak_t *soak)
{
    if (soak->synced)
        epx__bench_must(soak->rank, epx_group_barrier(soak->group), "epx_group_barrier");
    epx__bench_mark(soak->device, 0);
}

double epx__soak_elapsed_us(epx__soak_t *soak)
{
    double us[1] = {0};
    epx__bench_elapsed_us(soak->device, 2, us);
    return us[0];
}

static void *must_alloc(size_t bytes)
{
    void *memory = calloc(1, bytes > 0 ? bytes : 1);
    if (memory == NULL) {
        fprintf(stderr, "epx bench: soak: out of host memory\n");
        exit(1);
    }
    return memory;
}

/* Resident host memory of this process, MiB. */
static double host_rss_mb(void)
{
    FILE *file = fopen("/proc/self/statm", "r");
    long pages = 0, resident = 0;
    if (file == NULL)
        return 0;
    int got = fscanf(file, "%ld %ld", &pages, &resident);
    fclose(file);
    return got == 2 ? (double)resident * (double)sysconf(_SC_PAGESIZE) / 1048576.0 : 0;
}

/* Device memory in use on this rank's GPU (all processes), MiB; -1 without CUDA. */
static double gpu_used_mb(const epx__soak_t *soak)
{
#ifdef EPX_WITH_CUDA
    size_t free_bytes = 0, total = 0;
    if (soak->cuda && cudaMemGetInfo(&free_bytes, &total) == cudaSuccess)
        return (double)(total - free_bytes) / 1048576.0;
#else
    (void)soak;
#endif
    return -1;
}

/* ---------------------------------------------------------------- windows */

/* Latency samples of one op in the current window. */
typedef struct {
    double *values;
    int64_t count;
    int64_t capacity;
} series_t;

static void series_add(series_t *s, double value)
{
    if (s->count == s->capacity) {
        int64_t capacity = s->capacity > 0 ? 2 * s->capacity : 1024;
        double *grown = realloc(s->values, (size_t)capacity * sizeof(double));
        if (grown == NULL) {
            fprintf(stderr, "epx bench: soak: out of host memory for latencies\n");
            exit(1);
        }
        s->values = grown;
        s->capacity = capacity;
    }
    s->values[s->count++] = value;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One op's window on one rank. */
typedef struct {
    int64_t count;
    double p50, p99, p999, max; /* us */
} op_stats_t;

/* Nearest rank: the smallest value with at least q of the samples at or below it. */
static double percentile(const double *sorted, int64_t count, double q)
{
    int64_t index = (int64_t)ceil(q * (double)count) - 1;
    return sorted[index < 0 ? 0 : index >= count ? count - 1 : index];
}

static op_stats_t series_stats(series_t *s)
{
    op_stats_t stats = {s->count, 0, 0, 0, 0};
    if (s->count == 0)
        return stats;
    qsort(s->values, (size_t)s->count, sizeof(double), compare_doubles);
    stats.p50 = percentile(s->values, s->count, 0.50);
    stats.p99 = percentile(s->values, s->count, 0.99);
    stats.p999 = percentile(s->values, s->count, 0.999);
    stats.max = s->values[s->count - 1];
    return stats;
}

/* What each rank contributes at a window's end. */
typedef struct {
    op_stats_t ops[EPX__SOAK_OP_COUNT];
    int64_t rounds, checked, mismatches, peer_losses, async_errors;
    double detect_us; /* first detection in this window, 0 if none */
    double rss_mb, gpu_mb;
} window_t;

/* The worst rank's figure of each (counts from rank 0, sums of the failure counts). */
static window_t worst_of(const window_t *all, int count)
{
    window_t w = all[0];
    for (int r = 1; r < count; r++) {
        const window_t *o = &all[r];
        for (int op = 0; op < EPX__SOAK_OP_COUNT; op++) {
            w.ops[op].p50 = fmax(w.ops[op].p50, o->ops[op].p50);
            w.ops[op].p99 = fmax(w.ops[op].p99, o->ops[op].p99);
            w.ops[op].p999 = fmax(w.ops[op].p999, o->ops[op].p999);
            w.ops[op].max = fmax(w.ops[op].max, o->ops[op].max);
        }
        w.checked += o->checked;
        w.mismatches += o->mismatches;
        w.peer_losses += o->peer_losses;
        w.async_errors += o->async_errors;
        w.detect_us = fmax(w.detect_us, o->detect_us);
        w.rss_mb = fmax(w.rss_mb, o->rss_mb);
        w.gpu_mb = fmax(w.gpu_mb, o->gpu_mb);
    }
    return w;
}

static void print_window(FILE *out, int json, int index, double start_s, double end_s,
                         const window_t *w, int ranks)
{
    if (json) {
        fprintf(out, "{\"soak_window\": %d, \"start_s\": %.1f, \"end_s\": %.1f, \"ranks\": %d, "
                     "\"rounds\": %lld, \"checked\": %lld, \"mismatches\": %lld, "
                     "\"peer_losses\": %lld, \"async_errors\": %lld, \"detect_ms\": %.3f, "
                     "\"host_rss_mb\": %.1f, \"gpu_used_mb\": %.1f, \"ops\": {",
                index, start_s, end_s, ranks, (long long)w->rounds, (long long)w->checked,
                (long long)w->mismatches, (long long)w->peer_losses, (long long)w->async_errors,
                w->detect_us / 1e3, w->rss_mb, w->gpu_mb);
        int first = 1;
        for (int op = 0; op < EPX__SOAK_OP_COUNT; op++) {
            const op_stats_t *s = &w->ops[op];
            if (s->count == 0)
                continue;
            fprintf(out, "%s\"%s\": {\"count\": %lld, \"p50_us\": %.1f, \"p99_us\": %.1f, "
                         "\"p999_us\": %.1f, \"max_us\": %.1f}",
                    first ? "" : ", ", epx__soak_op_name((epx__soak_op_t)op), (long long)s->count,
                    s->p50, s->p99, s->p999, s->max);
            first = 0;
        }
        fprintf(out, "}}\n");
        fflush(out);
        return;
    }
    fprintf(out, "window %d [%.0f-%.0f s]: %lld rounds, %lld oracle comparisons, %lld mismatches, "
                 "%lld peer losses%s, host RSS %.1f MiB",
            index, start_s, end_s, (long long)w->rounds, (long long)w->checked,
            (long long)w->mismatches, (long long)w->peer_losses,
            w->async_errors > 0 ? " (async)" : "", w->rss_mb);
    if (w->gpu_mb >= 0)
        fprintf(out, ", GPU %.0f MiB", w->gpu_mb);
    if (w->detect_us > 0)
        fprintf(out, ", detected in %.1f ms", w->detect_us / 1e3);
    fprintf(out, "\n");
    for (int op = 0; op < EPX__SOAK_OP_COUNT; op++) {
        const op_stats_t *s = &w->ops[op];
        if (s->count > 0)
            fprintf(out, "  %-16s n %-7lld p50 %9.1f us  p99 %9.1f us  p99.9 %9.1f us  max "
                         "%9.1f us\n",
                    epx__soak_op_name((epx__soak_op_t)op), (long long)s->count, s->p50, s->p99,
                    s->p999, s->max);
    }
    fflush(out);
}

/* ---------------------------------------------------------------- the run */

/* The control words of one sync: each rank's state, and rank 0's decisions. */
typedef struct {
    int32_t failed;      /* this rank hit an unexpected failure */
    int32_t stop;        /* rank 0: stop after this sync */
    int32_t window_end;  /* rank 0: the window ends here */
    int32_t inject;      /* rank 0: the victim acts now; from here rounds are counted */
    int64_t rounds_left; /* rank 0, with inject: rounds still to run */
    int64_t window_rounds; /* rank 0, with inject: rounds per window from here on */
    double elapsed_s;    /* rank 0's clock */
    /* rank 0, with inject and --rejoin-after: rounds after the injection until the
     * rejoin (0 = none: the soak ends first), and the unique id of the rejoin's group. */
    int64_t rejoin_rounds;
    char rejoin_id[EPX__SOAK_ID_BYTES];
} control_t;

typedef struct {
    const epx__bench_options_t *options;
    const epx__soak_options_t *so;
    epx__soak_t soak;
    series_t series[EPX__SOAK_OP_COUNT];
    window_t current; /* counts of the window in progress */
    window_t first, last; /* the worst-rank windows printed first and last */
    int windows;
    /* Sums over the windows noted (every rank's counts while the ranks exchange them;
     * this rank's after a fault injection); rounds are rank 0's. */
    int64_t rounds, checked, mismatches, peer_losses, async_errors;
    double detect_us; /* the first detection seen in a window */
    int failed;       /* this rank's unexpected failure */
    int any_failed;   /* some rank's (learned at the syncs) */
    int async_seen;
    int64_t my_mismatches;
    int injected;  /* the injection happened, or this is the replacement: not again */
    int report_fd; /* the victim's pipe to its parent (bench_soak_rejoin.c), or -1 */
    /* --rejoin-after */
    int rejoin_failed, rejoined;
    double lost_at_s;   /* soak time of the injection */
    double rejoin_at_s; /* soak time of the rejoin */
    double rejoin_ms;   /* the survivors' group creation and epx_ll_rejoin */
    int64_t checked_after_rejoin, mismatches_after_rejoin; /* every rank's, from the windows */
    epx_group_t rejoin_group;
} soak_run_t;

/* Where the soak is: its clock, its windows, its rounds. */
typedef struct {
    int64_t start_ns;
    double window_s;
    double window_start, next_window;
    int64_t round;
    int printer;        /* the rank that prints the windows and the summary */
    control_t decision; /* the last sync's */
} schedule_t;

/* This rank's window: percentiles of its series (emptied), memory, counts. */
static window_t close_window(soak_run_t *run)
{
    window_t w = run->current;
    for (int op = 0; op < EPX__SOAK_OP_COUNT; op++) {
        w.ops[op] = series_stats(&run->series[op]);
        run->series[op].count = 0;
    }
    w.rss_mb = host_rss_mb();
    w.gpu_mb = gpu_used_mb(&run->soak);
    memset(&run->current, 0, sizeof(run->current));
    return w;
}

static void note_window(soak_run_t *run, const window_t *w)
{
    if (run->windows++ == 0)
        run->first = *w;
    run->last = *w;
    run->rounds += w->rounds;
    run->checked += w->checked;
    run->mismatches += w->mismatches;
    run->peer_losses += w->peer_losses;
    run->async_errors += w->async_errors;
    if (run->detect_us == 0)
        run->detect_us = w->detect_us;
    if (run->rejoined) {
        run->checked_after_rejoin += w->checked;
        run->mismatches_after_rejoin += w->mismatches;
    }
}

static void run_round(soak_run_t *run, int64_t round)
{
    epx__soak_t *soak = &run->soak;
    const epx__soak_options_t *so = run->so;
    uint64_t seed = run->options->seed * 0x100000001b3ull + (uint64_t)round;
    int check = round % so->check_every == 0 || round < 2; /* both modes checked at once */
    int ll = so->run_ll && (!so->run_normal || round % 2 == 1);
    epx__soak_round_t r;
    memset(&r, 0, sizeof(r));
    if (ll)
        epx__soak_ll_round(soak, seed, check, &r);
    else
        epx__soak_normal_round(soak, seed, check, &r);
    for (int op = 0; op < EPX__SOAK_OP_COUNT; op++)
        if (r.ran[op])
            series_add(&run->series[op], r.us[op]);
    /* A failure the device saw (or a peer lost on the GPU) shows here. */
    epx_status_t async = EPX_SUCCESS;
    char message[512] = "";
    if (epx_get_async_error(soak->buffer, &async, message, sizeof message) == EPX_SUCCESS &&
        async != EPX_SUCCESS && !run->async_seen) {
        run->async_seen = 1;
        run->current.async_errors++;
        fprintf(stderr, "epx bench: soak: rank %d: async error %s: %s\n", soak->rank,
                epx_status_name(async), message);
        if (!(ll && (async == EPX_ERR_TIMEOUT || async == EPX_ERR_REMOTE)))
            r.failed = 1;
    }
    run->current.rounds++;
    run->current.checked += r.checked;
    run->current.mismatches += r.mismatches;
    run->current.peer_losses += r.peer_losses;
    if (r.peer_losses > 0 && run->current.detect_us == 0)
        run->current.detect_us = r.detect_us;
    run->my_mismatches += r.mismatches;
    run->failed |= r.failed;
}

static void print_summary(soak_run_t *run, int ranks, double elapsed_s)
{
    const epx__bench_options_t *o = run->options;
    const window_t *a = &run->first, *b = &run->last;
    double rss_growth = b->rss_mb - a->rss_mb;
    double gpu_growth = a->gpu_mb >= 0 ? b->gpu_mb - a->gpu_mb : 0;
    int growth = rss_growth > fmax(8.0, 0.02 * a->rss_mb);
    if (o->json) {
        printf("{\"soak_summary\": true, \"elapsed_s\": %.1f, \"ranks\": %d, \"windows\": %d, "
               "\"rounds\": %lld, \"checked\": %lld, \"mismatches\": %lld, \"peer_losses\": "
               "%lld, \"detect_ms\": %.3f, \"failed\": %d, \"host_rss_growth_mb\": %.1f, "
               "\"gpu_used_growth_mb\": %.1f, \"memory_growth\": %s, \"rejoined\": %s, "
               "\"rejoin_ms\": %.3f, \"rejoin_after_loss_s\": %.1f, \"checked_after_rejoin\": "
               "%lld, \"mismatches_after_rejoin\": %lld, \"p99_drift\": {",
               elapsed_s, ranks, run->windows, (long long)run->rounds, (long long)run->checked,
               (long long)run->mismatches, (long long)run->peer_losses, run->detect_us / 1e3,
               run->failed || run->any_failed || run->rejoin_failed, rss_growth, gpu_growth,
               growth ? "true" : "false", run->rejoined ? "true" : "false", run->rejoin_ms,
               run->rejoined ? run->rejoin_at_s - run->lost_at_s : 0.0,
               (long long)run->checked_after_rejoin, (long long)run->mismatches_after_rejoin);
        int first = 1;
        for (int op = 0; op < EPX__SOAK_OP_COUNT; op++) {
            if (a->ops[op].count == 0 || b->ops[op].count == 0)
                continue;
            printf("%s\"%s\": %.3f", first ? "" : ", ", epx__soak_op_name((epx__soak_op_t)op),
                   b->ops[op].p99 / fmax(a->ops[op].p99, 1e-9));
            first = 0;
        }
        printf("}}\n");
        fflush(stdout);
        return;
    }
    printf("soak summary: %.0f s, %d ranks, %d windows, %lld rounds, %lld oracle comparisons, "
           "%lld mismatches, %lld peer losses%s\n",
           elapsed_s, ranks, run->windows, (long long)run->rounds, (long long)run->checked,
           (long long)run->mismatches, (long long)run->peer_losses,
           run->failed || run->any_failed || run->rejoin_failed ? ", FAILED" : "");
    if (run->detect_us > 0)
        printf("  a lost rank was detected (masked, serving went on) in %.1f ms\n",
               run->detect_us / 1e3);
    if (run->rejoined)
        printf("  rank %d rejoined %.1f s after its loss (new group and epx_ll_rejoin: %.1f ms); "
               "since then %lld oracle comparisons, %lld mismatches\n",
               run->so->inject_rank, run->rejoin_at_s - run->lost_at_s, run->rejoin_ms,
               (long long)run->checked_after_rejoin, (long long)run->mismatches_after_rejoin);
    else if (run->rejoin_failed)
        printf("  rank %d did not rejoin (FAILED, see the messages above)\n", run->so->inject_rank);
    printf("  host RSS %.1f MiB after the first window, %.1f MiB at the end (%+.1f MiB): %s\n",
           a->rss_mb, b->rss_mb, rss_growth, growth ? "GROWTH" : "no growth");
    if (a->gpu_mb >= 0)
        printf("  GPU memory in use %.0f MiB after the first window, %.0f MiB at the end "
               "(%+.0f MiB)\n",
               a->gpu_mb, b->gpu_mb, gpu_growth);
    for (int op = 0; op < EPX__SOAK_OP_COUNT; op++)
        if (a->ops[op].count > 0 && b->ops[op].count > 0)
            printf("  %-16s p99 %9.1f us in the first window, %9.1f us in the last (x%.2f)\n",
                   epx__soak_op_name((epx__soak_op_t)op), a->ops[op].p99, b->ops[op].p99,
                   b->ops[op].p99 / fmax(a->ops[op].p99, 1e-9));
    fflush(stdout);
}

/*
 * The victim's own end: SIGKILL (on the CUDA backend, where the process cannot fork a
 * child to die in its place, an immediate _exit with no cleanup: to the peers the same
 * loss), or silence past everyone's last wait. A victim to be replaced first tells its
 * parent the rejoin's group (bench_soak_rejoin.c).
 */
static void act_as_victim(const soak_run_t *run, const control_t *decision, int64_t timeout_ms)
{
    const epx__soak_options_t *so = run->so;
    fprintf(stderr, "epx bench: soak: rank %d: %s myself at %.1f s (--inject)\n", so->inject_rank,
            so->inject == EPX__SOAK_INJECT_KILL ? "killing" : "stopping", decision->elapsed_s);
    fflush(stderr);
    if (so->inject == EPX__SOAK_INJECT_KILL) {
        if (run->soak.cuda)
            _exit(0);
        if (decision->rejoin_rounds > 0)
            epx__soak_report_rejoin(run->report_fd, decision->rejoin_id);
        raise(SIGKILL);
    }
    double remaining = so->duration_s - decision->elapsed_s;
    sleep((unsigned)(fmax(remaining, 0) + 2.0 * (double)timeout_ms / 1e3 + 5));
    _exit(0);
}

static void soak_alloc(epx__soak_t *soak)
{
    int64_t rows = soak->max_tokens > soak->ll_tokens ? soak->max_tokens : soak->ll_tokens;
    int64_t h = soak->hidden, k = soak->topk;
    int64_t recv_rows = soak->max_tokens * soak->world;
    int64_t ll_rows = (int64_t)(soak->experts / soak->world) * soak->ll_tokens * soak->world;
    /* Combine's x from a separate tensor: the normal rows, and the low-latency
     * [L, M * R] layout when that is not too big (else low-latency rounds use the
     * zero-copy buffer only). */
    soak->ll_combine_x = ll_rows * h * 2 <= ((int64_t)256 << 20);
    int64_t combine_rows = soak->ll_combine_x && ll_rows > recv_rows ? ll_rows : recv_rows;
    struct {
        void **where;
        int64_t bytes;
    } want[] = {
        {&soak->x, rows * h * 2},
        {&soak->x_scales, rows * (h / 128 + 1) * 4},
        {&soak->topk_idx, rows * k * 8},
        {&soak->topk_weights, rows * k * 4},
        {&soak->out_x, rows * h * 2},
        {&soak->combine_x, combine_rows * h * 2},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        epx__bench_must(soak->rank,
                        epx__bench_alloc(soak->device, (size_t)want[i].bytes, want[i].where),
                        "soak memory");
}

static void soak_free(epx__soak_t *soak)
{
    void *memory[] = {soak->x, soak->x_scales, soak->topk_idx, soak->topk_weights, soak->out_x,
                      soak->combine_x};
    for (size_t i = 0; i < sizeof(memory) / sizeof(memory[0]); i++)
        epx__bench_free(soak->device, memory[i]);
}

/* Every rank's window, the worst of them printed by `printer` (when this rank). */
static void gather_window(soak_run_t *run, int printer, double start_s, double end_s)
{
    epx__soak_t *soak = &run->soak;
    window_t mine = close_window(run);
    window_t *all = must_alloc((size_t)soak->world * sizeof(window_t));
    epx__bench_allgather(soak->group, &mine, all, sizeof(mine), "soak window");
    window_t worst = worst_of(all, soak->world);
    note_window(run, &worst);
    if (soak->rank == printer)
        print_window(stdout, run->options->json, run->windows, start_s, end_s, &worst,
                     soak->world);
    free(all);
}

/* This rank's own window (after an injection, when the ranks no longer talk). */
static void own_window(soak_run_t *run, schedule_t *sc)
{
    double now = (double)(epx__tool_now_ns() - sc->start_ns) / 1e9;
    window_t w = close_window(run);
    note_window(run, &w);
    if (run->soak.rank == sc->printer)
        print_window(stdout, run->options->json, run->windows, sc->window_start, now, &w, 1);
    sc->window_start = now;
}

/* Everything a run needs but the buffer: the soak's view of the group and options. */
static void soak_init(soak_run_t *run, const epx__bench_options_t *options, epx_group_t group,
                      const epx_group_info_t *info, epx__bench_device_t *device,
                      schedule_t *sc, epx_buffer_config_t *config)
{
    const epx__soak_options_t *so = &options->soak;
    memset(run, 0, sizeof(*run));
    run->options = options;
    run->so = so;
    run->report_fd = -1;
    epx__soak_t *soak = &run->soak;
    soak->group = group;
    soak->device = device;
    soak->rank = info->rank;
    soak->world = info->world_size;
    soak->ranks_per_node = info->ranks_per_node;
    soak->cuda = info->backend == EPX_BACKEND_CUDA;
    soak->max_tokens = options->tokens;
    soak->ll_tokens = so->run_ll ? so->ll_tokens : 0;
    soak->hidden = options->hidden;
    soak->experts = options->experts;
    soak->topk = options->topk;
    soak->ll_dtype = options->ll_dtype;

    *config = epx__bench_buffer_config(options);
    config->max_low_latency_tokens = soak->ll_tokens;
    config->low_latency_dtype = options->ll_dtype;

    memset(sc, 0, sizeof(*sc));
    sc->window_s = so->window_s > 0 ? so->window_s : fmin(60.0, so->duration_s / 10.0);
    if (sc->window_s < 1)
        sc->window_s = 1;
    sc->next_window = sc->window_s;
}

/*
 * One untimed round of each mode asked for: what a process pays once (loading kernels,
 * NVSHMEM's first touch of its memory, a replacement's first touch of the segments) is
 * not a latency of the soak. Collective; 0 when it failed (message printed).
 */
static int warm_up(soak_run_t *run, int normal, int ll)
{
    epx__soak_t *soak = &run->soak;
    soak->synced = 1;
    for (int mode = 0; mode < 2; mode++) {
        if (!(mode == 0 ? normal : ll))
            continue;
        epx__soak_round_t warm;
        memset(&warm, 0, sizeof(warm));
        uint64_t seed = run->options->seed * 0x100000001b3ull - 1 - (uint64_t)mode;
        if (mode == 0)
            epx__soak_normal_round(soak, seed, 0, &warm);
        else
            epx__soak_ll_round(soak, seed, 0, &warm);
        if (warm.failed || warm.peer_losses > 0) {
            fprintf(stderr, "epx bench: soak: rank %d: the warm-up round failed\n", soak->rank);
            return 0;
        }
    }
    return 1;
}

/* Rank 0 at the injection: when the rejoin comes (in rounds) and the id of its group. */
static void plan_rejoin(const soak_run_t *run, double rate, control_t *mine)
{
    const epx__soak_options_t *so = run->so;
    if (so->rejoin_after_s <= 0)
        return;
    int64_t rounds = (int64_t)(rate * so->rejoin_after_s) + 1;
    epx_unique_id_t id;
    if (rounds >= mine->rounds_left) {
        fprintf(stderr, "epx bench: soak: the soak ends before --rejoin-after: no rejoin\n");
    } else if (epx_get_unique_id(&id) != EPX_SUCCESS ||
               epx_unique_id_to_string(&id, mine->rejoin_id, sizeof(mine->rejoin_id)) !=
                   EPX_SUCCESS) {
        fprintf(stderr, "epx bench: soak: no unique id for the rejoin: %s\n", epx_last_error());
    } else {
        mine->rejoin_rounds = rounds;
    }
}

/*
 * The synced phase: rounds, and every SYNC_ROUNDS the control words go round; ends when
 * rank 0 says stop, or at the injection.
 */
static void synced_phase(soak_run_t *run, schedule_t *sc)
{
    const epx__soak_options_t *so = run->so;
    epx__soak_t *soak = &run->soak;
    int stop = 0;
    while (!stop) {
        for (int i = 0; i < SYNC_ROUNDS && !run->failed; i++)
            run_round(run, sc->round++);
        double elapsed = (double)(epx__tool_now_ns() - sc->start_ns) / 1e9;
        control_t mine;
        memset(&mine, 0, sizeof(mine));
        mine.failed = run->failed;
        if (soak->rank == 0) {
            mine.elapsed_s = elapsed;
            mine.stop = elapsed >= so->duration_s;
            mine.window_end = elapsed >= sc->next_window || mine.stop;
            if (so->inject != EPX__SOAK_INJECT_NONE && !run->injected &&
                elapsed >= so->inject_at_s) {
                double rate = (double)sc->round / fmax(elapsed, 1e-3);
                mine.inject = 1;
                mine.rounds_left = (int64_t)(rate * fmax(so->duration_s - elapsed, 0)) + 1;
                mine.window_rounds = (int64_t)(rate * sc->window_s) + 1;
                mine.stop = 0;
                plan_rejoin(run, rate, &mine);
            }
        }
        control_t *all = must_alloc((size_t)soak->world * sizeof(control_t));
        epx__bench_allgather(soak->group, &mine, all, sizeof(mine), "soak control");
        sc->decision = all[0];
        int any_failed = 0;
        for (int r = 0; r < soak->world; r++)
            any_failed |= all[r].failed;
        free(all);
        if (any_failed)
            sc->decision.stop = sc->decision.window_end = 1, sc->decision.inject = 0;
        run->any_failed |= any_failed;
        if (sc->decision.window_end || sc->decision.inject) {
            gather_window(run, sc->printer, sc->window_start, sc->decision.elapsed_s);
            sc->window_start = sc->decision.elapsed_s;
            sc->next_window = sc->decision.elapsed_s + sc->window_s;
        }
        stop = sc->decision.stop || sc->decision.inject;
    }
}

/* What the ranks say to each other after a rejoin, so that the replacement catches up. */
typedef struct {
    int32_t newcomer;
    int32_t pad;
    int64_t round;
    double elapsed_s;
    double lost_at_s;
} resume_t;

/* After a rejoin: every rank takes the first survivor's round and clock. */
static void resume(soak_run_t *run, schedule_t *sc, int newcomer)
{
    epx__soak_t *soak = &run->soak;
    resume_t mine = {newcomer, 0, sc->round,
                     (double)(epx__tool_now_ns() - sc->start_ns) / 1e9, run->lost_at_s};
    resume_t *all = must_alloc((size_t)soak->world * sizeof(resume_t));
    epx__bench_allgather(soak->group, &mine, all, sizeof(mine), "soak resume");
    int first = 0;
    while (first < soak->world - 1 && all[first].newcomer)
        first++;
    resume_t agreed = all[first];
    free(all);
    if (newcomer) {
        sc->start_ns = epx__tool_now_ns() - (int64_t)(agreed.elapsed_s * 1e9);
        sc->round = agreed.round;
        run->lost_at_s = agreed.lost_at_s;
    }
    sc->window_start = agreed.elapsed_s;
    sc->next_window = agreed.elapsed_s + sc->window_s;
    memset(&sc->decision, 0, sizeof(sc->decision));
    run->injected = 1;
    run->rejoined = 1;
    run->rejoin_at_s = agreed.elapsed_s;
}

/* A survivor at the planned round: the new group, then epx_ll_rejoin. 1 on success. */
static int rejoin_survivor(soak_run_t *run, schedule_t *sc)
{
    epx__soak_t *soak = &run->soak;
    int64_t start = epx__tool_now_ns();
    epx_group_t group = NULL;
    epx_status_t status = epx__soak_rejoin_group(sc->decision.rejoin_id, soak->rank, soak->world,
                                                 0, &group);
    if (status == EPX_SUCCESS)
        status = epx_ll_rejoin(soak->buffer, group);
    double ms = (double)(epx__tool_now_ns() - start) / 1e6;
    if (status != EPX_SUCCESS) {
        fprintf(stderr, "epx bench: soak: rank %d: the rejoin of rank %d failed after %.0f ms: "
                        "%s: %s; serving on with it masked\n",
                soak->rank, run->so->inject_rank, ms, epx_status_name(status),
                epx__tool_error_text());
        if (group != NULL)
            epx_group_destroy(group);
        run->rejoin_failed = 1;
        return 0;
    }
    run->rejoin_ms = ms;
    run->rejoin_group = group;
    soak->group = group;
    resume(run, sc, 0);
    if (!warm_up(run, 0, 1)) /* with the replacement, which warms up too */
        run->failed = 1;
    if (soak->rank == sc->printer)
        fprintf(stderr, "epx bench: soak: rank %d rejoined at %.1f s (%.1f ms)\n",
                run->so->inject_rank, run->rejoin_at_s, ms);
    return 1;
}

/*
 * The injected phase: the victim acts; the others run a fixed number of rounds with no
 * exchange (the rendezvous goes through rank 0, which may be the one lost), windows by
 * round count. With a rejoin planned, at its round the survivors take the replacement in
 * and the soak goes back to the synced phase over the new group.
 */
static void injected_phase(soak_run_t *run, schedule_t *sc, int victim)
{
    const epx__soak_options_t *so = run->so;
    run->injected = 1;
    run->lost_at_s = sc->decision.elapsed_s;
    sc->printer = so->inject_rank == 0 ? 1 : 0;
    run->soak.synced = 0; /* no barrier before each op: the rendezvous may be gone */
    if (victim)
        act_as_victim(run, &sc->decision, epx__tool_param_int("EPX_TIMEOUT_MS"));
    int64_t in_window = 0;
    for (int64_t i = 0; i < sc->decision.rounds_left && !run->failed; i++) {
        if (sc->decision.rejoin_rounds > 0 && i == sc->decision.rejoin_rounds) {
            if (in_window > 0)
                own_window(run, sc);
            in_window = 0;
            if (rejoin_survivor(run, sc)) {
                synced_phase(run, sc);
                return;
            }
        }
        run_round(run, sc->round++);
        if (++in_window == sc->decision.window_rounds || i + 1 == sc->decision.rounds_left) {
            own_window(run, sc);
            in_window = 0;
        }
    }
}

/* The end: summary, memory, goodbyes. Returns the exit status. */
static int finish(soak_run_t *run, schedule_t *sc)
{
    epx__soak_t *soak = &run->soak;
    double elapsed = (double)(epx__tool_now_ns() - sc->start_ns) / 1e9;
    if (soak->rank == sc->printer)
        print_summary(run, soak->world, elapsed);
    int failed = run->failed || run->my_mismatches > 0 || run->rejoin_failed;
    soak_free(soak);
    for (int op = 0; op < EPX__SOAK_OP_COUNT; op++)
        free(run->series[op].values);
    if (run->injected && !run->rejoined) {
        /* The rendezvous channel may be broken and the lost rank will not vote in a
         * destroy: leave without the collective goodbyes (the process's end frees all). */
        fflush(stdout);
        fflush(stderr);
        _exit(failed ? 1 : 0);
    }
    /* Every rank is in (again): the buffer's destroy votes over its current group. */
    epx__bench_must(soak->rank, epx_buffer_destroy(soak->buffer), "epx_buffer_destroy");
    if (run->rejoin_group != NULL)
        epx__bench_must(soak->rank, epx_group_destroy(run->rejoin_group), "epx_group_destroy");
    return failed ? 1 : 0;
}

int epx__bench_soak_run(epx_group_t group, const epx__bench_options_t *options,
                        epx__bench_device_t *device)
{
    const epx__soak_options_t *so = &options->soak;
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    if (so->inject != EPX__SOAK_INJECT_NONE && (so->run_normal || so->inject_rank >= info.world_size ||
                                                info.world_size < 2)) {
        fprintf(stderr, "epx bench: --inject needs --soak-modes ll (a lost rank ends "
                            "normal mode), a rank below the world size and 2 or more ranks\n");
        return 2;
    }
    if (so->rejoin_after_s > 0 &&
        (so->inject != EPX__SOAK_INJECT_KILL || info.backend != EPX_BACKEND_HOST)) {
        fprintf(stderr, "epx bench: --rejoin-after needs --inject kill and the CPU backend (on "
                        "the GPU, NVSHMEM cannot take a process back into a running job: "
                        "docs/STABILITY.md)\n");
        return 2;
    }
    soak_run_t run;
    schedule_t sc;
    epx_buffer_config_t config;
    int victim = so->inject != EPX__SOAK_INJECT_NONE && info.rank == so->inject_rank;
    int report_fd = -1;
    if (victim && so->inject == EPX__SOAK_INJECT_KILL && info.backend != EPX_BACKEND_CUDA)
        report_fd = epx__soak_fork_victim(so); /* from here on the child that will die */
    soak_init(&run, options, group, &info, device, &sc, &config);
    run.report_fd = report_fd;
    epx__soak_t *soak = &run.soak;
    epx__bench_must(info.rank, epx_buffer_create(group, &config, &soak->buffer),
                    "epx_buffer_create");
    soak_alloc(soak);
    if (info.rank == 0 && !options->json)
        printf("epx bench --soak %.0f s: %s backend, %d ranks, %lld tokens/rank (normal max), "
               "%lld (low-latency M), hidden %lld, %d experts, top-%d, modes %s%s, windows of "
               "%.0f s, one round in %d checked against the oracle\n",
               so->duration_s, epx_backend_name(info.backend), info.world_size,
               (long long)options->tokens, (long long)soak->ll_tokens, (long long)options->hidden,
               options->experts, options->topk, so->run_normal ? "normal" : "",
               so->run_ll ? (so->run_normal ? "+ll" : "ll") : "", sc.window_s, so->check_every);
    if (!warm_up(&run, so->run_normal, so->run_ll))
        return 1;
    epx__bench_must(info.rank, epx_group_barrier(group), "epx_group_barrier");

    sc.start_ns = epx__tool_now_ns();
    synced_phase(&run, &sc);
    if (sc.decision.inject)
        injected_phase(&run, &sc, victim);
    return finish(&run, &sc);
}

int epx__bench_soak_newcomer(const epx__bench_options_t *options, epx__bench_device_t *device)
{
    const epx__soak_options_t *so = &options->soak;
    int rank = (int)epx__tool_param_int("EPX_RANK");
    int world = (int)epx__tool_param_int("EPX_WORLD_SIZE");
    /* The survivors come after --rejoin-after; wait for them a while longer. */
    double wait_s = so->rejoin_after_s + 2.0 * (double)epx__tool_param_int("EPX_TIMEOUT_MS") / 1e3 + 30;
    epx_group_t group = NULL;
    epx__bench_must(rank, epx__soak_rejoin_group(so->rejoin_id, rank, world, wait_s, &group),
                    "the rejoin's group");
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(rank, epx_group_get_info(group, &info), "epx_group_get_info");
    soak_run_t run;
    schedule_t sc;
    epx_buffer_config_t config;
    soak_init(&run, options, group, &info, device, &sc, &config);
    run.rejoin_group = group;
    sc.printer = so->inject_rank == 0 ? 1 : 0;
    epx__bench_must(rank, epx_buffer_create_rejoin(group, &config, &run.soak.buffer),
                    "epx_buffer_create_rejoin");
    soak_alloc(&run.soak);
    resume(&run, &sc, 1);
    fprintf(stderr, "epx bench: soak: rank %d: rejoined at round %lld\n", rank,
            (long long)sc.round);
    if (!warm_up(&run, 0, 1))
        run.failed = 1;
    synced_phase(&run, &sc);
    return finish(&run, &sc);
}
