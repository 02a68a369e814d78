/*
 * Expected traffic of low-latency mode's put path, counted from the routing, and how the
 * bench prints it (see bench_ll_nodes.h for the model). Pure functions.
 */
#include "bench_ll_nodes.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_report.h"

int epx__bench_ll_nodes_count(const epx__bench_nodes_shape_t *shape, int rank,
                              const int64_t *topk_idx, int64_t tokens,
                              epx__bench_ll_nodes_counts_t *counts)
{
    memset(counts, 0, sizeof(*counts));
    if (!epx__bench_nodes_shape_valid(shape) || rank < 0 || rank >= shape->world_size || tokens < 0)
        return -1;
    const int R = shape->world_size, E = shape->num_experts, k = shape->num_topk;
    const int per_node = shape->ranks_per_node, experts_per_rank = E / R;
    const int node = rank / per_node;
    /* Experts with rows from this rank, and the ranks token t reaches. */
    uint8_t *expert_hit = calloc((size_t)E, 1), *rank_hit = malloc((size_t)R);
    if (expert_hit == NULL || rank_hit == NULL) {
        free(expert_hit);
        free(rank_hit);
        return -1;
    }
    int status = 0;
    for (int64_t t = 0; t < tokens && status == 0; t++) {
        const int64_t *ids = topk_idx + t * k;
        memset(rank_hit, 0, (size_t)R);
        for (int j = 0; j < k; j++) {
            const int64_t e = ids[j];
            if (e < -1 || e >= E) {
                status = -1;
                break;
            }
            if (e < 0)
                continue;
            int repeated = 0;
            for (int i = 0; i < j; i++)
                repeated |= ids[i] == e;
            const int r = (int)(e / experts_per_rank);
            if (repeated || r / per_node == node)
                continue;
            counts->rows++;
            expert_hit[e] = 1;
            if (!rank_hit[r]) {
                rank_hit[r] = 1;
                counts->pairs++;
            }
        }
    }
    for (int e = 0; e < E; e++)
        counts->batches += expert_hit[e];
    counts->tokens = tokens;
    counts->peers = R - per_node;
    free(expert_hit);
    free(rank_hit);
    if (status != 0)
        memset(counts, 0, sizeof(*counts));
    return status;
}

epx__bench_ll_nodes_traffic_t epx__bench_ll_nodes_traffic(const epx__bench_nodes_shape_t *shape,
                                                          epx_dtype_t dtype,
                                                          const epx__bench_ll_nodes_counts_t *c)
{
    const int fp8 = dtype == EPX_DTYPE_FP8_E4M3;
    epx__bench_ll_nodes_traffic_t t;
    t.dispatch_row_bytes = fp8 ? shape->hidden + shape->hidden / 128 * 4 : shape->hidden * 2;
    /* Per batch: rows, (scales,) source tokens, positions with the signal; per peer: the
     * count words with theirs. */
    t.dispatch_messages = c->batches * (fp8 ? 4 : 3) + c->peers;
    t.dispatch_bytes = c->rows * (t.dispatch_row_bytes + 4 + 4) +
                       c->peers * ((int64_t)shape->num_experts + 1) * 8;
    t.combine_messages = c->rows;
    t.combine_bytes = c->rows * shape->hidden * 2;
    return t;
}

static double per_token(int64_t value, int64_t tokens)
{
    return tokens > 0 ? (double)value / (double)tokens : NAN;
}

static void print_json(FILE *out, const epx__bench_nodes_shape_t *shape, epx_dtype_t dtype,
                       const char *op, int64_t messages, int64_t bytes, int64_t bytes_rank0,
                       const epx__bench_ll_nodes_counts_t *total, int64_t rows_per_rank_bytes)
{
    epx__bench_nodes_print_json_start(out, "ll", shape, dtype, op);
    fprintf(out,
            ",\"tokens_total\":%lld,\"rows_total\":%lld,"
            "\"pairs_total\":%lld,\"batches_total\":%lld,\"peers_total\":%lld,"
            "\"messages_total\":%lld,\"network_bytes_total\":%lld,"
            "\"network_bytes_per_rank\":%lld",
            (long long)total->tokens, (long long)total->rows,
            (long long)total->pairs, (long long)total->batches, (long long)total->peers,
            (long long)messages, (long long)bytes, (long long)bytes_rank0);
    epx__bench_print_json_number(out, "network_messages_per_token",
                                 per_token(messages, total->tokens));
    epx__bench_print_json_number(out, "network_bytes_per_token", per_token(bytes, total->tokens));
    epx__bench_print_json_number(out, "rows_per_token", per_token(total->rows, total->tokens));
    epx__bench_print_json_number(out, "row_bytes_per_token_if_per_rank",
                                 per_token(rows_per_rank_bytes, total->tokens));
    fprintf(out, "}\n");
}

void epx__bench_ll_nodes_print(FILE *out, const epx__bench_nodes_shape_t *shape,
                               epx_dtype_t dtype, const epx__bench_ll_nodes_counts_t *rank0,
                               const epx__bench_ll_nodes_counts_t *total, int json, int explain)
{
    const epx__bench_ll_nodes_traffic_t all = epx__bench_ll_nodes_traffic(shape, dtype, total);
    const epx__bench_ll_nodes_traffic_t mine = epx__bench_ll_nodes_traffic(shape, dtype, rank0);
    /* Dispatch rows per (token, rank) instead of per (token, expert); combine keeps its
     * rows (a per-rank partial sum would change the summation order). */
    const int64_t dispatch_if_per_rank = total->pairs * all.dispatch_row_bytes;
    if (json) {
        print_json(out, shape, dtype, "dispatch", all.dispatch_messages, all.dispatch_bytes,
                   mine.dispatch_bytes, total, dispatch_if_per_rank);
        print_json(out, shape, dtype, "combine", all.combine_messages, all.combine_bytes,
                   mine.combine_bytes, total, total->rows * shape->hidden * 2);
        fflush(out);
        return;
    }
    if (explain)
        fprintf(out,
                "# put-path traffic across nodes, expected from the routing: one row per "
                "(token, expert in another node); dispatch\n"
                "#   puts per (expert, receiver) batch its rows, fp8 scales, source tokens and "
                "top-k positions (4 messages, bf16 3),\n"
                "#   plus the count words to each rank of the other nodes; combine puts each "
                "row back (1 message). if_per_rank:\n"
                "#   the dispatch's row bytes if rows went per (token, destination rank). Per "
                "rank: rank 0's tokens; per token: all ranks'\n");
    fprintf(out, "# put-path traffic, %d nodes x %d ranks:\n",
            shape->world_size / shape->ranks_per_node, shape->ranks_per_node);
    fprintf(out, "# %-5s %-9s %10s %10s %12s %12s %14s\n", "dtype", "op", "rows/token",
            "msgs/token", "net_B/token", "net_B/rank", "if_per_rank_B/t");
    const char *ops[] = {"dispatch", "combine"};
    const int64_t messages[] = {all.dispatch_messages, all.combine_messages};
    const int64_t bytes[] = {all.dispatch_bytes, all.combine_bytes};
    const int64_t bytes_rank0[] = {mine.dispatch_bytes, mine.combine_bytes};
    for (int i = 0; i < 2; i++) {
        fprintf(out, "  %-5s %-9s ", epx__bench_dtype_text(dtype), ops[i]);
        epx__bench_print_number(out, 10, 2, per_token(total->rows, total->tokens), "-");
        fputc(' ', out);
        epx__bench_print_number(out, 10, 2, per_token(messages[i], total->tokens), "-");
        fputc(' ', out);
        epx__bench_print_number(out, 12, 1, per_token(bytes[i], total->tokens), "-");
        fprintf(out, " %12lld ", (long long)bytes_rank0[i]);
        if (i == 0)
            epx__bench_print_number(out, 14, 1, per_token(dispatch_if_per_rank, total->tokens),
                                    "-");
        else
            fprintf(out, "%14s", "-");
        fputc('\n', out);
    }
    fflush(out);
}
