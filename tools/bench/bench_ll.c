/*
 * `epx bench --mode ll`: the low-latency ops of include/epx.h (docs/LOW_LATENCY.md) on
 * the standard decode case of docs/DESIGN.md section 5, in the manner of the normal mode
 * (bench_case.c): inputs from the seed, a first step run once and checked against the
 * oracle (tests/common/moe_ll.c) with --check, then timed iterations.
 *
 * An iteration is two low-latency steps, one per slot of the buffer:
 *   1. the whole calls: epx_ll_dispatch, then epx_ll_combine with x in the step's
 *      zero-copy combine buffer (epx_ll_get_combine_buffer), back to back;
 *   2. the split: epx_ll_dispatch with EPX_LL_SEND_ONLY, then epx_ll_receive; the same
 *      for combine. Each half is timed alone, and every rank's send has finished before
 *      any receive starts (its wait for the stream, then a barrier), which is the case
 *      the split is for: compute covered the transfer, so the receive only lands it.
 * Every phase starts after a barrier, so the ranks start together. Times come from the
 * bench's timestamps (bench_memory.h): CUDA events on the bench stream for the CUDA
 * backend, the wall clock for the host backend.
 *
 * The expert outputs are written into each slot's combine buffer once, in the first
 * step: every step has the same inputs, so it receives the same rows in the same order,
 * and no operation writes that memory. A combine buffer at an address not seen before
 * is filled again (outside the timed calls).
 *
 * Every rank runs the same sequence of collective calls whatever its check found, so a
 * wrong result on one rank is reported, never turned into a hang on the others.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_ll.h"
#include "bench_ll_case.h"
#include "bench_ll_nodes.h"
#include "moe_ll.h"

/* What every rank tells the others after the timed iterations. */
typedef struct {
    int64_t sent_rows;
    int64_t recv_rows;
    int64_t tokens;
    int32_t check[EPX__BENCH_LL_OP_COUNT];
    epx__bench_ll_nodes_counts_t traffic; /* its tokens' put-path traffic (several nodes) */
} rank_summary_t;

/* The put path's traffic of a case: rank 0's and every rank's (when the group spans
 * nodes; `counted` 0 otherwise). */
typedef struct {
    int counted;
    epx__bench_nodes_shape_t shape;
    epx__bench_ll_nodes_counts_t rank0, total;
} ll_traffic_t;

/* ---------------------------------------------------------------- one case */

static void *alloc_copy(ll_case_t *lc, const void *host, size_t bytes)
{
    void *data = NULL;
    epx__bench_must(lc->rank, epx__bench_alloc(lc->device, bytes, &data), "bench allocation");
    if (host != NULL)
        epx__bench_must(lc->rank, epx__bench_copy_in(lc->device, data, host, bytes), "bench copy");
    return data;
}

static void setup(ll_case_t *lc)
{
    const moe_case_t *c = &lc->moe;
    if (moe_ll_inputs_make(c, lc->rank, &lc->inputs) != 0) {
        fprintf(stderr, "epx bench: rank %d: out of memory making the inputs\n", lc->rank);
        exit(1);
    }
    size_t tokens = (size_t)lc->inputs.num_tokens, topk = (size_t)c->num_topk;
    lc->x = alloc_copy(lc, lc->inputs.x, tokens * (size_t)c->hidden * 2);
    lc->topk_idx = alloc_copy(lc, lc->inputs.topk_idx, tokens * topk * 8);
    lc->topk_weights = alloc_copy(lc, lc->inputs.topk_weights, tokens * topk * 4);
    lc->out = alloc_copy(lc, NULL, tokens * (size_t)c->hidden * 2);
    for (int i = 0; i < 2 && lc->options->wait_stats; i++)
        lc->wait_stats[i] = alloc_copy(lc, NULL, (size_t)lc->world_size * sizeof(int64_t));
    /* One row per (token, distinct expert): a token naming an expert twice sends once. */
    lc->sent_rows = 0;
    for (size_t t = 0; t < tokens; t++) {
        const int64_t *idx = lc->inputs.topk_idx + t * topk;
        for (size_t j = 0; j < topk; j++) {
            int first = idx[j] >= 0;
            for (size_t i = 0; i < j && first; i++)
                first = idx[i] != idx[j];
            lc->sent_rows += first;
        }
    }
}

static void teardown(ll_case_t *lc)
{
    void *memory[] = {lc->x, lc->topk_idx, lc->topk_weights, lc->out, lc->wait_stats[0],
                      lc->wait_stats[1]};
    for (size_t i = 0; i < sizeof(memory) / sizeof(memory[0]); i++)
        if (memory[i] != NULL)
            epx__bench_free(lc->device, memory[i]);
    moe_inputs_free(&lc->inputs);
    free(lc->recv_count);
    free(lc->expert_first);
    free(lc->expert_out);
}

/*
 * rows[op] from every rank's times ([rank][op][iteration]) and summaries: rank 0's
 * statistics, each rank's (into per_rank[op * ranks + rank]), the slowest rank's, and the
 * bytes and the floor (bench_report.h).
 */
static void make_rows(const ll_case_t *lc, epx_dtype_t dtype, const double *times, int iters,
                      const rank_summary_t *all, epx__bench_stats_t *per_rank,
                      epx__bench_ll_row_t rows[EPX__BENCH_LL_OP_COUNT])
{
    int world = lc->world_size;
    int64_t hidden = lc->moe.hidden;
    int64_t dispatch_row = epx__bench_ll_is_fp8(lc) ? hidden + hidden / 128 * 4 : hidden * 2;
    int64_t combine_row = hidden * 2;
    int64_t sent = 0, received = 0, tokens = 0;
    for (int r = 0; r < world; r++) {
        sent += all[r].sent_rows;
        received += all[r].recv_rows;
        tokens += all[r].tokens;
    }
    double *slowest = epx__bench_ll_host_alloc(lc, (size_t)(iters > 0 ? iters : 1) * sizeof(double), "times");
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++) {
        epx__bench_ll_row_t *row = &rows[op];
        memset(row, 0, sizeof(*row));
        row->dtype = dtype;
        row->op = (epx__bench_ll_op_t)op;
        /* NaN (not timed: CUDA graphs on the host backend) stays NaN. */
        for (int it = 0; it < iters; it++)
            slowest[it] = NAN;
        for (int r = 0; r < world; r++) {
            const double *mine = times + ((size_t)r * EPX__BENCH_LL_OP_COUNT + (size_t)op) *
                                             (size_t)iters;
            per_rank[op * world + r] = epx__bench_stats(mine, iters);
            for (int it = 0; it < iters; it++)
                if (!isnan(mine[it]) && (isnan(slowest[it]) || mine[it] > slowest[it]))
                    slowest[it] = mine[it];
        }
        row->per_rank = &per_rank[op * world];
        row->rank0 = row->per_rank[0];
        row->slowest = epx__bench_stats(slowest, iters);

        int is_dispatch = op == EPX__BENCH_LL_DISPATCH || op == EPX__BENCH_LL_DISPATCH_SEND ||
                          op == EPX__BENCH_LL_DISPATCH_RECV || op == EPX__BENCH_LL_LOOP_DISPATCH;
        if (op >= EPX__BENCH_LL_LAUNCH_LAG) { /* times only: no bytes, no floor */
            row->check = EPX__BENCH_CHECK_NONE;
            continue;
        }
        int is_step = op == EPX__BENCH_LL_LOOP_STEP || op == EPX__BENCH_LL_LOOP_SPLIT ||
                      op == EPX__BENCH_LL_GRAPH_STEP;
        /* Dispatch: each source token read once (bf16 x and its top-k ids), each row sent
         * written once where it lands. Combine: each expert row read once, each token's
         * top-k ids and weights read once and its reduced row written once. */
        int64_t topk = lc->moe.num_topk;
        int64_t dispatch_floor =
            epx__bench_dispatch_floor_bytes(tokens, hidden * 2 + topk * 8, sent, dispatch_row);
        int64_t combine_floor =
            epx__bench_combine_floor_bytes(tokens, topk * (8 + 4), received, combine_row);
        if (is_step) {
            row->bytes_per_rank = all[0].sent_rows * dispatch_row + all[0].recv_rows * combine_row;
            row->total_bytes = sent * dispatch_row + received * combine_row;
            row->floor_bytes = dispatch_floor + combine_floor;
        } else if (is_dispatch) {
            row->bytes_per_rank = all[0].sent_rows * dispatch_row;
            row->total_bytes = sent * dispatch_row;
            if (op == EPX__BENCH_LL_DISPATCH || op == EPX__BENCH_LL_LOOP_DISPATCH)
                row->floor_bytes = dispatch_floor;
        } else {
            row->bytes_per_rank = all[0].recv_rows * combine_row;
            row->total_bytes = received * combine_row;
            if (op == EPX__BENCH_LL_COMBINE || op == EPX__BENCH_LL_LOOP_COMBINE)
                row->floor_bytes = combine_floor;
        }
        row->check = lc->options->check ? EPX__BENCH_CHECK_PASS : EPX__BENCH_CHECK_NONE;
        for (int r = 0; r < world; r++) {
            if (all[r].check[op] == EPX__BENCH_CHECK_FAIL)
                row->check = EPX__BENCH_CHECK_FAIL;
        }
    }
    free(slowest);
}

/*
 * The launch lag rows hold host clock readings until every rank's are here (times:
 * [rank][op][iteration]): the time each rank left the barrier before the isolated
 * dispatch, and that time plus the dispatch's GPU time. Per iteration they become the lag
 * behind the first rank to leave, and the dispatch's end counted from the last rank's
 * leaving: what the dispatch costs once every rank has started, the barrier's skew taken
 * out (the slowest rank's lag is the skew).
 */
static void make_launch_lags(double *times, int world, int iters)
{
    size_t per_rank = (size_t)EPX__BENCH_LL_OP_COUNT * (size_t)iters;
    double *lags = times + (size_t)EPX__BENCH_LL_LAUNCH_LAG * (size_t)iters;
    double *ends = times + (size_t)EPX__BENCH_LL_DISPATCH_AFTER_LAST * (size_t)iters;
    for (int it = 0; it < iters; it++) {
        double first = INFINITY, last = -INFINITY;
        for (int r = 0; r < world; r++) {
            first = fmin(first, lags[r * per_rank + (size_t)it]);
            last = fmax(last, lags[r * per_rank + (size_t)it]);
        }
        for (int r = 0; r < world; r++) {
            ends[r * per_rank + (size_t)it] -= last;
            lags[r * per_rank + (size_t)it] -= first;
        }
    }
}

/* --wait-stats: every rank's two stats tensors, into waits [ranks][2][ranks] on every rank. */
static void gather_waits(ll_case_t *lc, int64_t *waits)
{
    size_t bytes = (size_t)lc->world_size * sizeof(int64_t);
    int64_t *mine = epx__bench_ll_host_alloc(lc, 2 * bytes, "wait stats");
    for (int i = 0; i < 2; i++)
        epx__bench_must(lc->rank,
                        epx__bench_copy_rows_out(lc->device, mine + i * lc->world_size,
                                                 lc->wait_stats[i], 1, bytes, bytes),
                        "copying wait_recv_cost_stats out");
    epx__bench_allgather(lc->group, mine, waits, 2 * bytes, "gathering wait stats");
    free(mine);
}

/* One dispatch dtype. Returns 1 when some rank's check failed. */
static int run_case(epx_group_t group, epx_buffer_t buffer, const epx__bench_options_t *options,
                    epx__bench_device_t *device, const epx__bench_context_t *context,
                    epx_dtype_t dtype, epx__bench_stats_t *per_rank,
                    epx__bench_ll_row_t rows[EPX__BENCH_LL_OP_COUNT], ll_traffic_t *traffic,
                    int64_t *waits)
{
    ll_case_t lc;
    memset(&lc, 0, sizeof(lc));
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    lc.group = group;
    lc.options = options;
    lc.device = device;
    lc.buffer = buffer;
    lc.rank = info.rank;
    lc.world_size = info.world_size;
    lc.num_local = options->experts / info.world_size;
    lc.rows = options->tokens * info.world_size;
    /* x is bf16 in; the oracle's inputs: random routing, no dropped entries (the node
     * split is normal-mode combine's; moe_ll.c has the low-latency order). */
    moe_case_t moe = {info.world_size, options->tokens, options->hidden, options->experts,
                      options->topk, EPX_DTYPE_BF16, 1, options->seed, MOE_ROUTING_RANDOM,
                      0.0, -1, 0, 0, 0};
    lc.moe = moe;
    if (dtype == EPX_DTYPE_FP8_E4M3) {
        lc.cast.use_fp8 = 1;
        lc.cast.round_scale = options->round_scale;
        lc.cast.use_ue8m0 = options->use_ue8m0;
    }
    snprintf(lc.label, sizeof(lc.label), "rank %d %s", lc.rank,
             epx__bench_dtype_text(dtype));

    setup(&lc);
    rank_summary_t mine;
    memset(&mine, 0, sizeof(mine));
    epx__bench_ll_run_first(&lc, mine.check);
    mine.sent_rows = lc.sent_rows;
    mine.recv_rows = lc.recv_rows;
    mine.tokens = lc.inputs.num_tokens;
    memset(traffic, 0, sizeof(*traffic));
    traffic->counted = info.ranks_per_node < info.world_size;
    if (traffic->counted) {
        epx__bench_nodes_shape_t shape = {info.world_size, info.ranks_per_node, options->experts,
                                          options->topk, options->hidden, dtype};
        traffic->shape = shape;
        if (epx__bench_ll_nodes_count(&shape, lc.rank, lc.inputs.topk_idx, lc.inputs.num_tokens,
                                      &mine.traffic) != 0) {
            fprintf(stderr, "epx bench: rank %d: cannot count the traffic of this routing\n",
                    lc.rank);
            exit(1);
        }
    }

    int iters = context->iters;
    size_t per_rank_times = (size_t)iters * EPX__BENCH_LL_OP_COUNT;
    double *my_times = epx__bench_ll_host_alloc(&lc, per_rank_times * sizeof(double), "times");
    double *times[EPX__BENCH_LL_OP_COUNT];
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++)
        times[op] = my_times + (size_t)op * (size_t)iters;
    epx__bench_ll_time_steps(&lc, context->warmup, iters, times);
    /* The loops and graph replays end with a plain step: its output must still be right. */
    if (lc.expected_out != NULL &&
        !epx__bench_ll_check_combine(&lc, "combine out after the back-to-back loops", lc.expected_out))
        mine.check[EPX__BENCH_LL_LOOP_STEP] = mine.check[EPX__BENCH_LL_LOOP_SPLIT] =
            mine.check[EPX__BENCH_LL_GRAPH_STEP] = EPX__BENCH_CHECK_FAIL;
    free(lc.expected_out);
    lc.expected_out = NULL;
    if (waits != NULL)
        gather_waits(&lc, waits);

    double *all_times =
        epx__bench_ll_host_alloc(&lc, per_rank_times * (size_t)lc.world_size * sizeof(double), "times");
    rank_summary_t *all = epx__bench_ll_host_alloc(&lc, (size_t)lc.world_size * sizeof(*all), "summaries");
    epx__bench_allgather(group, my_times, all_times, per_rank_times * sizeof(double),
                         "gathering times");
    epx__bench_allgather(group, &mine, all, sizeof(mine), "gathering check results");
    if (traffic->counted) {
        traffic->rank0 = all[0].traffic;
        for (int r = 0; r < lc.world_size; r++) {
            traffic->total.tokens += all[r].traffic.tokens;
            traffic->total.rows += all[r].traffic.rows;
            traffic->total.pairs += all[r].traffic.pairs;
            traffic->total.batches += all[r].traffic.batches;
            traffic->total.peers += all[r].traffic.peers;
        }
    }
    make_launch_lags(all_times, lc.world_size, iters);
    make_rows(&lc, dtype, all_times, iters, all, per_rank, rows);

    int failed = 0;
    for (int op = 0; op < EPX__BENCH_LL_OP_COUNT; op++)
        failed |= rows[op].check == EPX__BENCH_CHECK_FAIL;
    free(my_times);
    free(all_times);
    free(all);
    teardown(&lc);
    return failed;
}

int epx__bench_ll_run(epx_group_t group, const epx__bench_options_t *options,
                      epx__bench_device_t *device, const epx__bench_context_t *context)
{
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    epx_buffer_config_t config = epx__bench_buffer_config(options);
    config.max_low_latency_tokens = options->tokens;
    /* fp8 rows when the run dispatches fp8 only (bench.c chose it unless --ll-dtype). */
    config.low_latency_dtype = options->ll_dtype;
    /* The buffer's memory, and the part of it that low-latency mode adds. */
    epx_buffer_config_t normal_only = config;
    normal_only.max_low_latency_tokens = 0;
    size_t bytes = 0, normal_bytes = 0;
    epx__bench_must(info.rank, epx_buffer_size(group, &config, &bytes), "epx_buffer_size");
    epx__bench_must(info.rank, epx_buffer_size(group, &normal_only, &normal_bytes),
                    "epx_buffer_size");
    epx__bench_ll_context_t ll = {context, options->round_scale, options->use_ue8m0,
                                  (int64_t)bytes,
                                  bytes > normal_bytes ? (int64_t)(bytes - normal_bytes) : 0,
                                  options->ll_dtype};
    epx_buffer_t buffer = NULL;
    epx__bench_must(info.rank, epx_buffer_create(group, &config, &buffer), "epx_buffer_create");
    if (info.rank == 0 && !options->json)
        epx__bench_ll_print_header(stdout, &ll);

    int failed = 0, explained = 0;
    const epx_dtype_t dtypes[] = {EPX_DTYPE_BF16, EPX_DTYPE_FP8_E4M3};
    for (int d = 0; d < 2; d++) {
        if ((d == 0 && !options->run_bf16) || (d == 1 && !options->run_fp8))
            continue;
        epx__bench_ll_row_t rows[EPX__BENCH_LL_OP_COUNT];
        epx__bench_stats_t *per_rank = calloc(
            (size_t)EPX__BENCH_LL_OP_COUNT * (size_t)info.world_size, sizeof(*per_rank));
        if (per_rank == NULL) {
            fprintf(stderr, "epx bench: rank %d: out of memory\n", info.rank);
            exit(1);
        }
        ll_traffic_t traffic;
        int64_t *waits = NULL;
        if (options->wait_stats) {
            waits = calloc((size_t)info.world_size * 2 * (size_t)info.world_size, sizeof(int64_t));
            if (waits == NULL) {
                fprintf(stderr, "epx bench: rank %d: out of memory\n", info.rank);
                exit(1);
            }
        }
        failed |= run_case(group, buffer, options, device, context, dtypes[d], per_rank, rows,
                           &traffic, waits);
        /* CUDA graphs exist on the GPU backend only: elsewhere that row is left out. */
        int printed = info.backend == EPX_BACKEND_CUDA ? EPX__BENCH_LL_OP_COUNT
                                                       : EPX__BENCH_LL_GRAPH_STEP;
        if (info.rank == 0) {
            for (int op = 0; op < printed; op++)
                epx__bench_ll_print_row(stdout, &ll, &rows[op], options->json);
            if (!options->json)
                epx__bench_ll_print_per_rank(stdout, &ll, rows, printed);
            if (traffic.counted)
                epx__bench_ll_nodes_print(stdout, &traffic.shape, dtypes[d], &traffic.rank0,
                                          &traffic.total, options->json, !explained);
            if (waits != NULL)
                epx__bench_ll_print_waits(stdout, &ll, dtypes[d], waits, options->json);
            explained = 1;
        }
        free(waits);
        free(per_rank);
    }
    epx__bench_must(info.rank, epx_buffer_destroy(buffer), "epx_buffer_destroy");
    return failed;
}
