/*
 * `epx bench --mode ll`: the timed iterations of a case (the whole calls, the split
 * send/receive halves, and the graph-replayed step), timed with the bench's timestamps.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "bench_ll.h"
#include "bench_ll_case.h"
#include "moe_ll.h"

/* ---------------------------------------------------------------- timing */

/* The host's monotonic clock in us: the same clock in every process of the machine. */
static double host_now_us(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e6 + (double)now.tv_nsec / 1e3;
}

static void barrier(ll_case_t *lc)
{
    epx__bench_must(lc->rank, epx_group_barrier(lc->group), "epx_group_barrier");
}

static void mark(ll_case_t *lc, int index)
{
    epx__bench_must(lc->rank, epx__bench_mark(lc->device, index), "timestamp");
}

/* Waits for the stream (CUDA), so a barrier after it means every rank's work is done. */
static void read_marks(ll_case_t *lc, int marks, double *durations_us)
{
    epx__bench_must(lc->rank, epx__bench_elapsed_us(lc->device, marks, durations_us),
                    "reading timestamps");
}

/* Steps per timed loop (two timestamps each, one more at the end). */
#define LOOP_STEPS 16

/*
 * Steps back to back, `warmup` + `iters` of each kind, in loops of LOOP_STEPS after one
 * barrier: per-op times of plain steps, then whole steps with the split.
 */
static void time_loops(ll_case_t *lc, int warmup, int iters,
                       double *times[EPX__BENCH_LL_OP_COUNT])
{
    double d[2 * LOOP_STEPS];
    for (int done = -warmup; done < iters; done += LOOP_STEPS) {
        barrier(lc);
        for (int i = 0; i < LOOP_STEPS; i++) {
            mark(lc, 2 * i);
            epx_ll_dispatch_result_t step = epx__bench_ll_run_dispatch(lc, 0);
            mark(lc, 2 * i + 1);
            epx_tensor_t x = epx__bench_ll_combine_input(lc, step.handle);
            epx__bench_ll_run_combine(lc, step.handle, &x, 0);
        }
        mark(lc, 2 * LOOP_STEPS);
        read_marks(lc, 2 * LOOP_STEPS + 1, d);
        for (int i = 0; i < LOOP_STEPS; i++) {
            int sample = done + i;
            if (sample < 0 || sample >= iters)
                continue;
            times[EPX__BENCH_LL_LOOP_DISPATCH][sample] = d[2 * i];
            times[EPX__BENCH_LL_LOOP_COMBINE][sample] = d[2 * i + 1];
            times[EPX__BENCH_LL_LOOP_STEP][sample] = d[2 * i] + d[2 * i + 1];
        }
    }
    for (int done = -warmup; done < iters; done += LOOP_STEPS) {
        barrier(lc);
        for (int i = 0; i < LOOP_STEPS; i++) {
            mark(lc, i);
            epx_ll_dispatch_result_t step = epx__bench_ll_run_dispatch(lc, EPX_LL_SEND_ONLY);
            epx__bench_ll_run_receive(lc, step.handle, "epx_ll_receive (dispatch)");
            epx_tensor_t x = epx__bench_ll_combine_input(lc, step.handle);
            epx__bench_ll_run_combine(lc, step.handle, &x, EPX_LL_SEND_ONLY);
            epx__bench_ll_run_receive(lc, step.handle, "epx_ll_receive (combine)");
        }
        mark(lc, LOOP_STEPS);
        read_marks(lc, LOOP_STEPS + 1, d);
        for (int i = 0; i < LOOP_STEPS; i++) {
            int sample = done + i;
            if (sample >= 0 && sample < iters)
                times[EPX__BENCH_LL_LOOP_SPLIT][sample] = d[i];
        }
    }
}

/*
 * LOOP_STEPS plain steps captured once in a CUDA graph, then `warmup` + `iters` replays,
 * each timed: a sample is the replay's time / LOOP_STEPS. NaN on the host backend.
 */
static void time_graph(ll_case_t *lc, int warmup, int iters, double *times)
{
    void *graph = NULL;
    int cuda = lc->device->backend == EPX_BACKEND_CUDA;
    if (cuda) {
        epx__bench_must(lc->rank, epx__bench_graph_begin(lc->device), "graph capture");
        for (int i = 0; i < LOOP_STEPS; i++) {
            epx_ll_dispatch_result_t step = epx__bench_ll_run_dispatch(lc, 0);
            epx_tensor_t x = epx__bench_ll_combine_input(lc, step.handle);
            epx__bench_ll_run_combine(lc, step.handle, &x, 0);
        }
        epx__bench_must(lc->rank, epx__bench_graph_end(lc->device, &graph), "graph capture");
    }
    for (int it = -warmup; it < iters; it++) {
        double d = NAN;
        if (cuda) {
            barrier(lc);
            mark(lc, 0);
            epx__bench_must(lc->rank, epx__bench_graph_launch(lc->device, graph), "graph launch");
            mark(lc, 1);
            read_marks(lc, 2, &d);
            d /= LOOP_STEPS;
        }
        if (it >= 0)
            times[it] = d;
    }
    epx__bench_graph_destroy(graph);
}

void epx__bench_ll_time_steps(ll_case_t *lc, int warmup, int iters,
                       double *times[EPX__BENCH_LL_OP_COUNT])
{
    for (int it = 0; it < warmup + iters; it++) {
        double t[EPX__BENCH_LL_OP_COUNT], whole[3];
        /* The whole calls, back to back like a decode step without overlap. */
        barrier(lc);
        double left = host_now_us(); /* made relative to the other ranks after the run */
        mark(lc, 0);
        epx_ll_dispatch_result_t step = epx__bench_ll_run_dispatch(lc, 0);
        mark(lc, 1);
        epx_tensor_t x = epx__bench_ll_combine_input(lc, step.handle); /* a local lookup */
        mark(lc, 2);
        epx__bench_ll_run_combine(lc, step.handle, &x, 0);
        mark(lc, 3);
        read_marks(lc, 4, whole);
        t[EPX__BENCH_LL_DISPATCH] = whole[0];
        t[EPX__BENCH_LL_COMBINE] = whole[2];

        /* The split: each half alone, every rank's send done before the receives. */
        barrier(lc);
        mark(lc, 0);
        step = epx__bench_ll_run_dispatch(lc, EPX_LL_SEND_ONLY);
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_DISPATCH_SEND]);
        barrier(lc);
        mark(lc, 0);
        epx__bench_ll_run_receive(lc, step.handle, "epx_ll_receive (dispatch)");
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_DISPATCH_RECV]);
        x = epx__bench_ll_combine_input(lc, step.handle);
        barrier(lc);
        mark(lc, 0);
        epx__bench_ll_run_combine(lc, step.handle, &x, EPX_LL_SEND_ONLY);
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_COMBINE_SEND]);
        barrier(lc);
        mark(lc, 0);
        epx__bench_ll_run_receive(lc, step.handle, "epx_ll_receive (combine)");
        mark(lc, 1);
        read_marks(lc, 2, &t[EPX__BENCH_LL_COMBINE_RECV]);

        if (it >= warmup) {
            for (int op = 0; op <= EPX__BENCH_LL_COMBINE_RECV; op++)
                times[op][it - warmup] = t[op];
            times[EPX__BENCH_LL_LAUNCH_LAG][it - warmup] = left;
            times[EPX__BENCH_LL_DISPATCH_AFTER_LAST][it - warmup] = left + t[EPX__BENCH_LL_DISPATCH];
        }
    }
    time_loops(lc, warmup, iters, times);
    time_graph(lc, warmup, iters, times[EPX__BENCH_LL_GRAPH_STEP]);
}
