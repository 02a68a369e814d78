/*
 * `epx bench` across nodes, the collective part: every rank counts the traffic of its own
 * tokens (bench_nodes.c) on the routing the timed case uses, rank 0 gathers the counts
 * and prints the expected figures for dispatch and combine, after the CUDA backend's
 * internode plan of the buffer (memory, warps).
 */
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "bench_nodes.h"
#include "moe_case.h"

/* The CUDA backend's internode plan of the run's buffer, on rank 0, once per run. */
static void report_plan(const epx_group_info_t *info, int64_t tokens, int64_t hidden,
                        int experts, int topk, int sms, epx_dtype_t dtype, int json)
{
    if (info->backend != EPX_BACKEND_CUDA)
        return;
    epx_buffer_config_t config = EPX_BUFFER_CONFIG_INIT;
    config.max_tokens_per_rank = tokens;
    config.hidden = hidden;
    config.num_experts = experts;
    config.num_topk = topk;
    config.num_sms = sms;
    config.dispatch_dtype = dtype;
    epx_internode_plan_t plan = EPX_INTERNODE_PLAN_INIT;
    if (epx_internode_plan(info->world_size, info->ranks_per_node, &config, &plan) ==
        EPX_SUCCESS)
        epx__bench_nodes_print_plan(stdout, &plan, json);
    else if (!json)
        printf("# internode plan: unknown (%s)\n", epx_last_error());
}

void epx__bench_nodes_report(epx_group_t group, int64_t tokens, int64_t hidden, int experts,
                             int topk, int sms, uint64_t seed, epx_dtype_t dtype, int json,
                             int explain)
{
    epx_group_info_t info = EPX_GROUP_INFO_INIT;
    epx__bench_must(-1, epx_group_get_info(group, &info), "epx_group_get_info");
    /* The timed case's inputs (bench_case.c): the routing depends on the seed only. */
    moe_case_t moe = {info.world_size, tokens, hidden, experts, topk, dtype, 1, seed,
                      MOE_ROUTING_RANDOM, 0.0, -1, info.ranks_per_node, 0, 0};
    epx__bench_nodes_shape_t shape = {info.world_size, info.ranks_per_node, experts, topk,
                                      hidden, dtype};
    int64_t mine_tokens = moe_tokens_of_rank(&moe, info.rank);
    int64_t *idx = malloc((size_t)(mine_tokens > 0 ? mine_tokens : 1) * (size_t)topk *
                          sizeof(int64_t));
    epx__bench_nodes_counts_t mine, *all = calloc((size_t)info.world_size, sizeof(mine));
    if (idx == NULL || all == NULL) {
        fprintf(stderr, "epx bench: rank %d: out of memory counting the traffic\n", info.rank);
        exit(1);
    }
    if (moe_routing_make(&moe, info.rank, idx) != mine_tokens ||
        epx__bench_nodes_count(&shape, info.rank, idx, mine_tokens, &mine) != 0) {
        fprintf(stderr, "epx bench: rank %d: cannot count the traffic of this routing\n",
                info.rank);
        exit(1);
    }
    epx__bench_allgather(group, &mine, all, sizeof(mine), "gathering traffic counts");

    if (info.rank == 0) {
        epx__bench_nodes_counts_t total = {0, 0, 0, 0};
        for (int r = 0; r < info.world_size; r++) {
            total.tokens += all[r].tokens;
            total.records += all[r].records;
            total.home_rows += all[r].home_rows;
            total.forwarded_rows += all[r].forwarded_rows;
        }
        if (explain)
            report_plan(&info, tokens, hidden, experts, topk, sms, dtype, json);
        if (!json)
            epx__bench_nodes_print_header(stdout, &shape, explain);
        const epx__bench_nodes_op_t ops[] = {EPX__BENCH_NODES_DISPATCH, EPX__BENCH_NODES_COMBINE};
        for (int i = 0; i < 2; i++) {
            epx__bench_nodes_row_t row = {ops[i], dtype, epx__bench_nodes_sizes(&shape, ops[i]),
                                          all[0], total};
            epx__bench_nodes_print_row(stdout, &shape, &row, json);
        }
    }
    free(idx);
    free(all);
}
